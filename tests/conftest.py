import os
import sys
from pathlib import Path

import torch

# tests import their helpers (tiny_models) by module name.
sys.path.insert(0, str(Path(__file__).parent))
# Deterministic and quiet: 2 threads (the CI machine's cores), no hub access ever.
torch.set_num_threads(2)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines decode eagerly unless a test asks for compilation (tests/test_compiled_decode.py does):
# compiling SmolLM2 in every test that serves it would cost minutes of the suite.
os.environ.setdefault("KEEL_COMPILE", "0")
