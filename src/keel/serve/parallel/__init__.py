"""Tensor- and pipeline-parallel serving (issue 11, in progress): the sharding layout and shard-wise
weight loading so far; workers and the engine integration come next."""
