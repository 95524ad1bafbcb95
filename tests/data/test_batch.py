import json

import numpy as np
import pytest

from bytelatent.data.batch import Batch


def make(patches: bool) -> Batch:
    x = np.arange(8, dtype=np.int64).reshape(2, 4)
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=bool)
    pl = np.array([[1, 4, 0], [1, 2, 2]], dtype=np.int64) if patches else None
    return Batch(x=x, y=x + 1, mask=mask, patch_lengths=pl)


@pytest.mark.parametrize("patches", [True, False])
def test_json_round_trip(patches):
    batch = make(patches)
    again = Batch.from_python_dict(json.loads(json.dumps(batch.to_python_dict())))
    assert again.equals(batch)
    assert again.x.dtype == np.int64 and again.mask.dtype == bool
    assert batch.n_target_bytes() == 7
    assert not again.equals(make(not patches))


def test_shape_checks():
    x = np.zeros((2, 4), dtype=np.int64)
    with pytest.raises(ValueError, match="share one"):
        Batch(x=x, y=x[:, :3], mask=x.astype(bool))
    with pytest.raises(ValueError, match="patch_lengths"):
        Batch(x=x, y=x, mask=x.astype(bool), patch_lengths=np.ones((3, 2), dtype=np.int64))
