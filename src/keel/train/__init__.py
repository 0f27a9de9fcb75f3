"""keel train: pretraining and continued pretraining on one model definition.

`config` holds the TOML schema and the parallel layout arithmetic (pure, checkable before any process
group starts); `data` prepares token files and feeds batches whose global order does not depend on the
data-parallel layout, so a run resumes exactly on any number of ranks.
"""
