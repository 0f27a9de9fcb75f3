"""`keel plan`: memory and time planning for training and serving (issue 8, in progress).

So far: model structure from any config.json (quantized releases included, `structure_only`), and
the ZeRO memory arithmetic of sharded mixed-precision training (`keel.plan.zero`).
"""
