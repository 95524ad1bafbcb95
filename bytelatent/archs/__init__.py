"""The built-in architectures, one folder each (docs/extending.md): adding one is a folder and
a line here. Their specs are torch-free; the registry imports this list on first use."""

from bytelatent.archs.blt.spec import SPEC as BLT
from bytelatent.archs.hnet.spec import SPEC as HNET
from bytelatent.archs.lm.spec import SPEC as LM

BUILTINS = (BLT, LM, HNET)
