"""Reading shards from S3 (a real moto server on 127.0.0.1) through the whole pipeline."""

import os

import pytest
from datagen import batches_equal

from bytelatent.data.args import DataArgs
from bytelatent.data.iterators.states import load_state
from bytelatent.errors import DataError

pytest.importorskip("moto", reason="S3 test needs `pip install 'moto[server]' 's3fs[boto3]'`")
s3fs = pytest.importorskip(
    "s3fs", reason="S3 test needs `pip install 'moto[server]' 's3fs[boto3]'`"
)

pytestmark = pytest.mark.s3


def upload(local_root, bucket: str) -> str:
    fs = s3fs.S3FileSystem()
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    for directory, _, files in os.walk(local_root):
        for name in files:
            path = os.path.join(directory, name)
            fs.put_file(path, f"{bucket}/data/{os.path.relpath(path, local_root)}")
    return f"s3://{bucket}/data"


def args_for(root: str) -> DataArgs:
    return DataArgs(
        root_dir=root,
        sources={"a": 1.0, "b": 1.0},
        batch_size=2,
        seq_len=10,
        max_encoder_seq_length=32,
        buffer_size=3,
        load_async=False,
        patcher_args={"patching_mode": "space"},
    )


def take(it, n):
    return [next(it) for _ in range(n)]


def test_pipeline_reads_s3_and_resumes_exactly(corpus, s3_env):
    root = upload(corpus, "blt-data")
    s3_args = args_for(root)
    assert all(p.startswith("s3://blt-data/data/a/") for p in s3_args.files_of("a"))
    local = take(args_for(str(corpus)).build_from_rank(0, 1), 12)
    straight = take(s3_args.build_from_rank(0, 1), 12)
    assert batches_equal(straight, local)  # same bytes, wherever they live
    it = s3_args.build_from_rank(0, 1)
    head = take(it, 5)
    state = it.get_state().model_dump_json()
    files = load_state(state).source.sources["b"].source.source.file_state.shards
    assert "s3://blt-data/data/b/b.shard_0.arrow" in [shard.path for shard in files]
    assert batches_equal(head + take(s3_args.build_from_rank(0, 1, state=state), 7), straight)


def test_missing_s3_prefix_is_a_data_error(corpus, s3_env):
    upload(corpus, "blt-data2")
    with pytest.raises(DataError, match=r"s3://blt-data2/data/nope does not exist"):
        DataArgs(
            root_dir="s3://blt-data2/data", sources={"nope": 1.0}, load_async=False
        ).build_from_rank(0, 1)
