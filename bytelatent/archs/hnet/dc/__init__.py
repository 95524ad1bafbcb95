"""H-Net dynamic chunking (Hwang, Wang, Gu 2025), written from the equations in
shared/conformance/hnet/README.md and checked against the official code's outputs there."""

from bytelatent.archs.hnet.dc.chunking import ChunkLayer, ChunkOutput, DeChunkLayer, dechunk
from bytelatent.archs.hnet.dc.ema import ema_scan, ema_scan_sequential
from bytelatent.archs.hnet.dc.ratio_loss import boundary_statistics, load_balancing_loss, ratio_loss
from bytelatent.archs.hnet.dc.residual import ResidualProjection, merge_residual, straight_through
from bytelatent.archs.hnet.dc.routing import RoutingModule, RoutingOutput
from bytelatent.archs.hnet.dc.stage import DCStage, IdentityMixer, StageOutput

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
