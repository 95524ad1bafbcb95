"""The tiny models every CLI test trains (one definition; tests add their own data/loop keys).

Sized so that a run, start-up included, takes seconds on 2 shared cores: one global layer of
width 32, one local layer each side, two hash n-gram sizes, short windows. `config=` is an
an absolute path (ENTROPY_CONFIG, BLT_CONFIG) so that runs from any working directory (tests/integration) read the same file.
"""

from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
ENTROPY_CONFIG = CONFIGS / "entropy_debug.yaml"
BLT_CONFIG = CONFIGS / "debug.yaml"

# The debug configs validate every 100 steps; a test's tiny run does when the test asks for it
# (eval.every=N after these lists): its own data roots need no *.val.jsonl, and runs stay short.
NO_EVAL = ["eval.every=0"]

# The entropy model (ENTROPY_CONFIG shrunk): data.seq_len up to max_seqlen.
TINY_ENTROPY_MODEL = [
    *NO_EVAL,
    "entropy_model.dim=32",
    "entropy_model.n_layers=1",
    "entropy_model.n_heads=2",
    "entropy_model.max_seqlen=128",
    "entropy_model.sliding_window=64",
]

# The BLT (BLT_CONFIG shrunk, space patching): data.seq_len (patches) up to 48.
TINY_BLT_MODEL = [
    *NO_EVAL,
    "model.dim=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.max_seqlen=48",
    "model.dim_local_encoder=32",
    "model.dim_local_decoder=32",
    "model.n_layers_local_encoder=1",
    "model.n_layers_local_decoder=1",
    "model.n_heads_local_encoder=2",
    "model.n_heads_local_decoder=2",
    "model.cross_attn_nheads=2",
    "model.local_attention_window_len=64",
    "model.encoder_hash_byte_group_size=[3,4]",
    "model.encoder_hash_byte_group_vocab=512",
    "model.max_encoder_seq_length=256",
    "data.max_encoder_seq_length=256",
]
