"""H-Net dynamic chunking (Hwang, Wang, Gu 2025), written from the equations in
shared/conformance/hnet/README.md and checked against the official code's outputs there."""

from bytelatent.model.hnet.chunking import ChunkLayer, ChunkOutput, DeChunkLayer, dechunk
from bytelatent.model.hnet.ema import ema_scan, ema_scan_sequential
from bytelatent.model.hnet.ratio_loss import boundary_statistics, load_balancing_loss, ratio_loss
from bytelatent.model.hnet.residual import ResidualProjection, merge_residual, straight_through
from bytelatent.model.hnet.routing import RoutingModule, RoutingOutput
from bytelatent.model.hnet.stage import DCStage, IdentityMixer, StageOutput

__all__ = [
    "ChunkLayer",
    "ChunkOutput",
    "DCStage",
    "DeChunkLayer",
    "IdentityMixer",
    "ResidualProjection",
    "RoutingModule",
    "RoutingOutput",
    "StageOutput",
    "boundary_statistics",
    "dechunk",
    "ema_scan",
    "ema_scan_sequential",
    "load_balancing_loss",
    "merge_residual",
    "ratio_loss",
    "straight_through",
]
