"""Reading shards from S3 (a real moto server on 127.0.0.1) through the whole pipeline."""

import os

import pytest
from datagen import batches_equal

from bytelatent.data.args import DataArgs
from bytelatent.data.iterators.states import load_state
from bytelatent.errors import DataError
from tests.extras import lazy_extra
from tests.limits import hang_limit

lazy_extra("moto", reason="S3 test needs `pip install 'moto[server]' 's3fs[boto3]'`")
s3fs = lazy_extra("s3fs", reason="S3 test needs `pip install 'moto[server]' 's3fs[boto3]'`")

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


# Run in a fresh interpreter: pytest's own fork server may already hold an S3 environment.
_ENV_AFTER_SERVER = """
import os, sys
from multiprocessing import forkserver
from bytelatent.data.args import DataArgs
from bytelatent.data.worker_server import worker_context

worker_context("forkserver")
forkserver.ensure_running()  # in the environment of this moment: no S3 endpoint
os.environ.update(AWS_ENDPOINT_URL=sys.argv[2], **dict(a.split("=", 1) for a in sys.argv[3:]))
args = DataArgs.model_validate_json(sys.argv[1])
for load_async in (True, False):
    it = args.model_copy(update={"load_async": load_async}).build_from_rank(0, 1)
    print(load_async, [int(next(it).x.sum()) for _ in range(4)])
    if load_async:
        it.close()
"""


def test_async_loader_reads_s3_with_the_environment_set_after_its_fork_server_started(
    corpus, s3_env
):
    """`python -m bytelatent.train` starts the data loader's fork server before anything else
    (data/worker_server.py), so the server's environment predates the run's `env:` keys and
    credentials; the worker must use the trainer's environment as it is when the worker starts."""
    import subprocess
    import sys

    from tests.conftest import S3_ENV

    root = upload(corpus, "blt-data-env")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    argv = [args_for(root).model_dump_json(), s3_env, *(f"{k}={v}" for k, v in S3_ENV.items())]
    res = subprocess.run([sys.executable, "-c", _ENV_AFTER_SERVER, *argv], env=env,
                         capture_output=True, text=True, timeout=hang_limit(120))  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    async_line, sync_line = res.stdout.splitlines()
    assert async_line.split(" ", 1)[1] == sync_line.split(" ", 1)[1], res.stdout
