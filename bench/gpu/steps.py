"""The steps of bench/gpu/check.py; each returns its summary entry (a dict) or raises.

Every step runs the package's real code paths (Trainer, attention, checkpoint manager,
generator): with ``quick`` on tiny shapes and few steps, so CI runs the same code as the GPU.
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import json
import math
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MAX_FILE = 15 * 2**20  # what comes back from $OUT: 16 MiB a file


class CheckFailed(Exception):
    """A check did not hold (the step's status becomes `fail`)."""


class Skip(Exception):
    """The step cannot run here (e.g. CUDA-only); the message says why."""


def run(name: str, device: str, quick: bool, out: Path, work: Path, no_fsdp: bool = False) -> dict:
    """Step `name`; `no_fsdp`: the driver's NCCL probe failed, train without single-device FSDP."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise Skip("--device cuda but torch.cuda.is_available() is False")
    torch.manual_seed(0)
    return globals()[f"step_{name}"](Ctx(device, quick, out, work, no_fsdp))


class Ctx:
    def __init__(self, device: str, quick: bool, out: Path, work: Path, no_fsdp: bool = False):
        self.device, self.quick, self.out, self.work = device, quick, out, work
        self.cuda = device == "cuda"
        self.no_fsdp = no_fsdp
        self.compile_watch: CompileWatch | None = None

    def sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()


def expect(ok: bool, message: str) -> None:
    if not ok:
        raise CheckFailed(message)


class CompileWatch:
    """torch.compile'd calls under a raised recompile limit, each timed, none allowed to run
    uncompiled.

    Flex attention compiles once per shape, dtype and mask structure (`dynamic=False`): the
    attention step's cases are more than dynamo's default limit (8), and past it dynamo falls back
    to eager without an error: flex would then run unfused and still pass. Within the watch the
    limit is `limit`, hitting it raises (`fail_on_recompile_limit_hit`), and a call counts as
    uncompiled when dynamo gave up on a frame (frames total > ok) or flex warned that it ran
    without torch.compile (the limit hit raises `CheckFailed` at once; the others are listed). Names as in torch 2.11 and 2.13 (older: `cache_size_limit`).
    """

    def __init__(self, limit: int = 64):
        self.limit = limit
        self.compiles: list[dict] = []  # calls that compiled: case, seconds, frames compiled
        self.uncompiled: list[str] = []
        self._patch: Any = None

    def __enter__(self) -> CompileWatch:
        import torch._dynamo

        config = torch._dynamo.config
        limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        settings: dict[str, Any] = {limit: self.limit}
        for fail in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"):
            if hasattr(config, fail):
                settings[fail] = True
                break
        self._patch = config.patch(**settings)
        self._patch.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._patch.__exit__(*exc)

    @contextlib.contextmanager
    def call(self, label: str):
        """Watch one call (`label` names it in the summary)."""
        import warnings

        from torch._dynamo.utils import counters

        total, ok = counters["frames"]["total"], counters["frames"]["ok"]
        graphs = counters["stats"]["unique_graphs"]  # fullgraph compiles count here only
        started = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                yield
            except Exception as e:
                if "recompile" in type(e).__name__.lower() or "recompile" in str(e).lower():
                    self.uncompiled.append(f"{label}: {type(e).__name__}: {str(e)[:200]}")
                    raise CheckFailed(f"flex would run uncompiled: {self.uncompiled[-1]}") from e
                raise
        seconds = time.perf_counter() - started
        for w in caught:  # the rest go where they would have gone
            if "without torch.compile" in str(w.message):
                self.uncompiled.append(f"{label}: {str(w.message).splitlines()[0]}")
            else:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        new_total = counters["frames"]["total"] - total
        new_ok = counters["frames"]["ok"] - ok
        if new_total > new_ok:
            self.uncompiled.append(f"{label}: dynamo gave up on {new_total - new_ok} frame(s)")
        new_graphs = counters["stats"]["unique_graphs"] - graphs
        if new_ok or new_graphs:
            self.compiles.append({"case": label, "seconds": round(seconds, 2), "frames": new_ok,
                                  "graphs": new_graphs})  # fmt: skip


# ---------------------------------------------------------------------------------------------
# environment


def step_env(ctx: Ctx) -> dict:
    import torch

    from bytelatent import compat

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "threads": torch.get_num_threads(),
        "packages": _versions(
            [
                "numpy",
                "pydantic",
                "pydantic_core",
                "omegaconf",
                "yaml",
                "pyarrow",
                "fsspec",
                "triton",
                "xformers",
            ]
        ),
        "torch_compat": compat.report(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info |= {
            "gpu": props.name,
            "capability": f"{props.major}.{props.minor}",
            "gpu_mem_gib": round(props.total_memory / 2**30, 1),
            "sms": props.multi_processor_count,
            "bf16": torch.cuda.is_bf16_supported(),
        }
        if shutil.which("nvidia-smi"):
            smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
            info["nvidia_smi"] = smi.stdout.strip()
    import bytelatent.train  # noqa: F401 - the entry point imports on this torch

    return info


def _versions(names: list[str]) -> dict[str, str | None]:
    import importlib

    found = {}
    for name in names:
        try:
            found[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as e:  # noqa: BLE001 - a missing or broken package is what we report
            found[name] = f"missing ({type(e).__name__})"
    return found


# ---------------------------------------------------------------------------------------------
# attention backends against a float64 brute force


def step_attention(ctx: Ctx) -> dict:
    import torch

    from bytelatent.model import attention as A

    backends = ["sdpa"]
    if ctx.cuda:
        backends.append("flex_attention")
        if A.xformers_available():
            backends.append("xformers")
    lengths = (256, 1024) if ctx.quick else (256, 8192)
    tol = {torch.float32: 2e-3 if ctx.cuda else 1e-4, torch.bfloat16: 5e-2}
    results, failures = [], []
    with CompileWatch() as watch:
        ctx.compile_watch = watch
        try:
            _attention_cases(ctx, backends, lengths, tol, results, failures)
        finally:
            ctx.compile_watch = None
    if ctx.cuda:
        torch.cuda.empty_cache()
    expect(not watch.uncompiled, f"flex ran uncompiled (unfused eager) in: {watch.uncompiled[:4]}")
    expect(not failures, f"{len(failures)} attention case(s) above tolerance: {failures[:4]}")
    worst = {
        d: max(max(r["out"], r["dq"], r["dk"], r["dv"]) for r in results if r["dtype"] == d)
        for d in ("float32", "bfloat16")
    }
    return {
        "backends": backends,
        "cases": len(results),
        "worst_rel_err": worst,
        "tolerance": {str(k)[6:]: v for k, v in tol.items()},
        "flex_compiles": watch.compiles,
        "recompile_limit": watch.limit,
        "results": results,
    }


def _attention_cases(ctx: Ctx, backends, lengths, tol, results: list, failures: list) -> None:
    import torch

    from bytelatent.model import attention as A

    dev = torch.device(ctx.device)
    for seqlen in lengths:
        for kind, window in (("causal", None), ("block_causal", None), ("local_block_causal", 128)):
            tokens = _packed_rows(2, seqlen, dev)
            allowed = A.dense_self_attn_mask(kind, tokens, A_EOS, window)[:, 0]
            case = _attention_case(ctx, 2, 4, 2, seqlen, seqlen, 64 if not ctx.quick else 32)
            ref = _brute_force(case, allowed)
            for backend in backends:
                mask = A.self_attn_mask(kind, tokens, A_EOS, window, backend=backend)
                for dtype in (torch.float32, torch.bfloat16):
                    label = f"S={seqlen} {kind} {str(dtype)[6:]}"
                    err = _compare(case, ref, dtype, mask, backend, ctx.compile_watch, label)
                    row = {
                        "S": seqlen,
                        "kind": kind,
                        "backend": backend,
                        "dtype": str(dtype)[6:],
                        **err,
                        "banded": isinstance(mask, A.SdpaBanded),
                    }
                    results.append(row)
                    if max(err.values()) > tol[dtype]:
                        failures.append(row)
        results += _cross_cases(ctx, backends, tol, failures)
    results += _patch_cross_cases(ctx, backends, tol, failures)


A_EOS = 2  # bytelatent.tokenizers.constants.EOS_ID


def _packed_rows(bsz: int, seqlen: int, device) -> Any:
    import torch

    gen = torch.Generator().manual_seed(seqlen)
    tokens = torch.randint(4, 260, (bsz, seqlen), generator=gen)
    for row in range(bsz):
        cuts = torch.randperm(seqlen, generator=gen)[: 2 + 3 * row]
        tokens[row, cuts] = A_EOS
    return tokens.to(device)


def _attention_case(ctx, bsz, heads, kv_heads, q_len, k_len, dim) -> dict:
    import torch

    gen = torch.Generator(device="cpu").manual_seed(q_len * 31 + k_len)
    shape_q, shape_k = (bsz, heads, q_len, dim), (bsz, kv_heads, k_len, dim)
    case = {
        n: torch.randn(s, generator=gen, dtype=torch.float64)
        for n, s in (("q", shape_q), ("k", shape_k), ("v", shape_k), ("g", shape_q))
    }
    return {n: t.to(ctx.device) for n, t in case.items()}


def _brute_force(case: dict, allowed) -> dict:
    """out and grads in float64; rows with no allowed key give zeros (as `attend` promises)."""
    import torch

    q, k, v = (case[n].clone().requires_grad_() for n in "qkv")
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    has_key = allowed.any(-1)[:, None, :, None]
    probs = torch.softmax(scores.masked_fill(~has_key, 0.0), dim=-1) * has_key
    out = probs @ vv
    (out * case["g"]).sum().backward()
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _compare(case: dict, ref: dict, dtype, mask, backend: str, watch=None, label="") -> dict:
    from bytelatent.model.attention import attend

    q, k, v = (case[n].to(dtype).requires_grad_() for n in "qkv")
    watching = watch.call(label) if watch is not None and backend == "flex_attention" else None
    with watching or contextlib.nullcontext():
        out = attend(q, k, v, mask, backend)
        (out.float() * case["g"].float()).sum().backward()
    got = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    # error relative to the largest reference value of each tensor
    return {
        n: round(
            float((got[n].double() - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-12)), 7
        )
        for n in got
    }


def _cross_cases(ctx: Ctx, backends, tol, failures) -> list[dict]:
    """Cross-attention masks (queries = bytes, keys = patches) with windows and empty rows."""
    import torch

    from bytelatent.model import attention as A

    rows = []
    q_len, k_len = (192, 48) if ctx.quick else (2048, 512)
    q_pos = torch.arange(q_len, device=ctx.device)[:, None]
    k_pos = torch.arange(k_len, device=ctx.device)[None, :] * (q_len // k_len)
    allowed = (k_pos <= q_pos) & (q_pos - k_pos < 2 * (q_len // k_len))
    allowed = torch.stack([allowed, allowed.clone()])
    allowed[1, :7] = False  # empty query rows (e.g. padding): exact zeros expected
    allowed[0, -5:] = False
    case = _attention_case(ctx, 2, 4, 4, q_len, k_len, 32)
    ref = _brute_force(case, allowed)
    mask = A.AttnMask.from_dense(allowed[:, None])
    for backend in [
        b for b in backends if b != "flex_attention"
    ]:  # flex: BLT patch masks only (_patch_cross_cases)
        for dtype in (torch.float32, torch.bfloat16):
            err = _compare(case, ref, dtype, mask, backend)
            row = {
                "S": f"{q_len}x{k_len}",
                "kind": "cross+empty_rows",
                "backend": backend,
                "dtype": str(dtype)[6:],
                **err,
            }
            rows.append(row)
            if max(err.values()) > tol[dtype]:
                failures.append(row)
    return rows


def _patch_cross_cases(ctx: Ctx, backends, tol, failures) -> list[dict]:
    """The BLT's windowed patch cross-attention masks (build_cross_mask: flex gets a BlockMask
    from per-query key bounds), encoder and decoder side, with padded patches (empty rows)."""
    import torch

    from bytelatent.archs.blt import patch_utils as PU

    n_bytes, k = (200, 2) if ctx.quick else (4096, 2)
    gen = torch.Generator().manual_seed(n_bytes)
    rows = []
    for row in range(2):
        lengths = [1] + torch.randint(1, 9, (n_bytes,), generator=gen).tolist()
        ends = torch.tensor(lengths).cumsum(0)
        rows.append(lengths[: int((ends < n_bytes + row).sum())])
        rows[-1].append(n_bytes + row - sum(rows[-1]))  # rows sum to N or N+1
    width = max(map(len, rows)) + 5  # padded patches: empty encoder query rows
    lengths = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=ctx.device)
    results = []
    for side, window in (("encoder", None), ("encoder", 3), ("decoder", 2)):
        ids_of = (
            PU.patch_ids_from_lengths if side == "encoder" else PU.decoder_patch_ids_from_lengths
        )
        ids = ids_of(lengths, n_bytes)
        dense_of = (
            PU.encoder_cross_attn_allowed if side == "encoder" else PU.decoder_cross_attn_allowed
        )
        allowed = dense_of(ids, width, k, window)[:, 0]
        q_len, k_len = allowed.shape[1:]
        case = _attention_case(ctx, 2, 4, 4, q_len, k_len, 32)
        ref = _brute_force(case, allowed)
        for backend in backends:
            mask = PU.build_cross_mask(side, ids, width, k, window, backend, structured=False).attn
            for dtype in (torch.float32, torch.bfloat16):
                label = f"{side}_cross(w={window}) {str(dtype)[6:]}"
                err = _compare(case, ref, dtype, mask, backend, ctx.compile_watch, label)
                row = {"S": f"{q_len}x{k_len}", "kind": f"{side}_cross(w={window})",
                       "backend": backend, "dtype": str(dtype)[6:], **err}  # fmt: skip
                results.append(row)
                if max(err.values()) > tol[dtype]:
                    failures.append(row)
    return results


# ---------------------------------------------------------------------------------------------
# Trainer-based steps


def corpus(ctx: Ctx) -> Path:
    """The stdlib corpus under work/data (prepared once per check run)."""
    root = ctx.work / "data"
    if not (root / "stdlib").exists():
        mb = "1" if ctx.quick else "8"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "bytelatent.data.prepare",
                "--out",
                str(root / "stdlib"),
                "--max-mb",
                mb,
            ],
            check=True,
            cwd=REPO,
        )
    return root


TINY_BLT = [
    "config=configs/debug.yaml",
    "model.dim=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.dim_local_encoder=32",
    "model.dim_local_decoder=32",
    "model.n_heads_local_encoder=2",
    "model.n_heads_local_decoder=2",
    "model.cross_attn_nheads=2",
    "model.n_layers_local_decoder=1",
    "model.encoder_hash_byte_group_vocab=257",
    "model.max_encoder_seq_length=256",
    "model.local_attention_window_len=64",
    "data.max_encoder_seq_length=256",
    "data.seq_len=48",
    "model.max_seqlen=48",
]
TINY_ENTROPY = [
    "config=configs/entropy_debug.yaml",
    "entropy_model.dim=32",
    "entropy_model.n_layers=1",
    "entropy_model.n_heads=2",
    "entropy_model.max_seqlen=128",
    "entropy_model.sliding_window=64",
    "data.seq_len=128",
    "data.batch_size=4",
]


def blt_argv(ctx: Ctx) -> list[str]:
    """The debug BLT (GPU) or a tiny one (quick)."""
    return list(TINY_BLT) if ctx.quick else ["config=configs/debug.yaml", "data.batch_size=8"]


def entropy_argv(ctx: Ctx) -> list[str]:
    if ctx.quick:
        return list(TINY_ENTROPY)
    return ["config=configs/entropy_model.yaml", "data.batch_size=4"]


def make_trainer(ctx: Ctx, name: str, argv: list[str], fresh: bool = True):
    """A Trainer on this device for `argv` in work/runs/name (emptied first unless resuming);
    bf16 on CUDA, fp32 on CPU."""
    from bytelatent.args import TrainArgs
    from bytelatent.config import parse_args
    from bytelatent.distributed.env import setup_distributed
    from bytelatent.trainer.trainer import Trainer

    dump = ctx.work / "runs" / name
    if fresh:
        shutil.rmtree(dump, ignore_errors=True)
    dump.mkdir(parents=True, exist_ok=True)
    dtype = "bf16" if ctx.cuda else "fp32"
    argv = [
        *argv,
        f"dump_dir={dump}",
        f"data.root_dir={corpus(ctx)}",
        "data.sources={stdlib: 1.0}",
        "data.load_async=false",
        f"distributed.model_dtype={dtype}",
        "logging.freq=1",
        "checkpoint.dump.every=0",
        "checkpoint.eval.every=0",
        "eval.every=0",
    ]
    args = parse_args(TrainArgs, fsdp_argv(ctx, argv))
    return Trainer(args, setup_distributed(args.distributed))


def fsdp_argv(ctx: Ctx, argv: list[str]) -> list[str]:
    """`argv` with single-device FSDP turned off when the driver's NCCL probe failed."""
    if not ctx.no_fsdp:
        return argv
    key = "distributed.single_device_fsdp="
    return [a for a in argv if not a.startswith(key)] + [f"{key}false"]


def _params(model) -> dict:
    from torch.distributed.tensor import DTensor

    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
        for n, p in model.named_parameters()
    }


def _same(a: dict, b: dict) -> list[str]:
    import torch

    return [n for n in a if not torch.equal(a[n], b[n])]


def step_train_step(ctx: Ctx) -> dict:
    """A NaN-poisoned step that must leave the weights unchanged, then a whole training step
    under torch.cuda.set_sync_debug_mode (every host sync it makes is listed)."""
    trainer = make_trainer(ctx, "train_step", blt_argv(ctx))
    try:
        trainer.train_step(trainer.next_batches())  # warm-up: allocations, first-call syncs
        before = _params(trainer.model)
        hook = trainer.model.register_forward_hook(lambda m, i, o: o * float("nan"))
        try:
            out = trainer.train_step(trainer.next_batches())
        finally:
            hook.remove()
        changed = _same(before, _params(trainer.model))
        guard = trainer.guard.read()
        expect(not math.isfinite(float(out.loss_sum)), "the poisoned step's loss is finite")
        expect(not changed, f"a NaN step changed {len(changed)} parameters, e.g. {changed[:3]}")
        sync = _sync_debug_step(ctx, trainer)
        expect(sync in ("no host sync", "n/a on cpu"), sync)
        return {"sync_debug": sync, "nan_step_weights_unchanged": True, "guard": guard}
    finally:
        trainer.close()


def _sync_debug_step(ctx: Ctx, trainer) -> str:
    """Every host sync of one step, as `file:line (aten op)` (see `host_syncs`)."""
    batches = trainer.next_batches()
    ctx.sync()
    if not ctx.cuda:
        trainer.train_step(batches)
        return "n/a on cpu"
    sites = host_syncs(lambda: trainer.train_step(batches))
    if not sites:
        return "no host sync"
    return "host sync at " + ", ".join(f"{k} x{v}" for k, v in sites.most_common(12))


def host_syncs(fn) -> collections.Counter:
    """The host syncs of `fn()` under `torch.cuda.set_sync_debug_mode("warn")`, counted by the
    first frame of this repository and the aten op that synced (`file:line (op)`).

    Backward runs on the calling thread here: on autograd's device threads a sync's warning was
    deferred to the next Python call, and the first GPU run (2026-12-04) could only name
    torch/cuda/__init__.py. A dispatch mode names the op whose call raised the warning; a sync
    outside any op keeps the warning's own file:line. Switching the mode raises one warning of
    its own (torch 2.11: an empty window gives one at torch/cuda/__init__.py, in
    set_sync_debug_mode; bench/gpu/sync_origin.py, 2026-12-04), so an empty window's sites are
    subtracted."""
    if fn is not None:
        return _host_syncs(fn) - _host_syncs(None)
    return _host_syncs(None)


def _host_syncs(fn) -> collections.Counter:
    import warnings

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    sites: collections.Counter = collections.Counter()
    caught: list = []  # the warnings recorded so far (bound below)

    def syncs(ws) -> int:
        return sum("synchroniz" in str(w.message) for w in ws)

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            n = len(caught)
            out = func(*args, **(kwargs or {}))
            found = syncs(caught[n:])
            if found:
                sites[f"{repo_frame()} ({func})"] += found
                del caught[n:]  # attributed: not counted again below
            return out

    with warnings.catch_warnings(record=True) as recorded:
        caught = recorded  # noqa: F841 - read by Watch through the closure
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            if fn is not None:
                with torch.autograd.set_multithreading_enabled(False), Watch():
                    fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        for w in caught:
            if "synchroniz" in str(w.message):
                sites[f"{Path(w.filename).parent.name}/{Path(w.filename).name}:{w.lineno}"] += 1
    return sites


def repo_frame() -> str:
    """`path:line` of the innermost caller in this repository (not bench/gpu, not a venv)."""
    import traceback

    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename)
        if REPO in path.parents and HERE not in path.parents and "site-packages" not in path.parts:
            return f"{path.relative_to(REPO)}:{frame.lineno}"
    return "outside the repository"


def step_fsdp_dcp(ctx: Ctx) -> dict:
    """FSDP2 on one device (a 1-rank mesh), an async DCP save, and a resume bitwise."""
    from torch.distributed.tensor import DTensor

    if ctx.no_fsdp:
        raise Skip("a 1-rank NCCL group could not start here (the driver's probe): no FSDP2")
    argv = [
        *entropy_argv(ctx),
        "steps=3",
        "distributed.single_device_fsdp=true",
        "checkpoint.async_save=true",
    ]
    first = make_trainer(ctx, "fsdp", argv)
    try:
        expect(first.mesh is not None, "single_device_fsdp=true built no mesh")
        expect(
            all(isinstance(p, DTensor) for p in first.model.parameters()),
            "parameters are not DTensors",
        )
        first.train()
        saved = _params(first.model)
        saved_opt = _opt_state(first)
    finally:
        first.close()
    resumed = make_trainer(ctx, "fsdp", argv, fresh=False)  # same args and dump_dir: a resume
    try:
        expect(resumed.state.step == 3, f"resumed at step {resumed.state.step}, expected 3")
        diff = _same(saved, _params(resumed.model))
        expect(not diff, f"{len(diff)} parameters differ after the DCP round trip: {diff[:3]}")
        opt_diff = _same(saved_opt, _opt_state(resumed))
        expect(not opt_diff, f"optimizer state differs after load: {opt_diff[:3]}")
        return {"mesh": str(resumed.mesh), "params": len(saved), "bitwise": True}
    finally:
        resumed.close()


def _opt_state(trainer) -> dict:
    from torch.distributed.tensor import DTensor

    flat = {}
    for i, state in enumerate(trainer.optimizer.state.values()):
        for key, value in state.items():
            t = value.full_tensor() if isinstance(value, DTensor) else value
            flat[f"{i}.{key}"] = t.detach().cpu().clone()
    return flat


def step_deterministic(ctx: Ctx) -> dict:
    """Two identical runs with distributed.deterministic=true: losses and weights bitwise equal;
    a third run without it gives the mode's cost (step time on vs off). That one runs first, in a
    forked child with CUBLAS_WORKSPACE_CONFIG unset: cuBLAS reads it when its handle is created,
    so a run in this process after the deterministic ones would time their cuBLAS set-up."""
    n_steps = 2 if ctx.quick else 5
    s_off = _in_clean_child(ctx, lambda: _timed_run(ctx, "nondet", False, n_steps)[0][2])
    runs, batches = {}, None
    for name in ("det_a", "det_b"):
        runs[name], batches = _timed_run(ctx, name, True, n_steps, batches)
    (la, pa, sa), (lb, pb, sb) = runs["det_a"], runs["det_b"]
    diff = _same(pa, pb)
    expect(la == lb, f"losses differ: {la} vs {lb}")
    expect(not diff, f"{len(diff)} parameters differ: {diff[:3]}")
    return {
        "steps": n_steps,
        "losses": la,
        "bitwise": True,
        "step_s_deterministic": round(min(sa, sb), 4),
        "step_s_default": round(s_off, 4),
        "default_run_env": "fresh child, CUBLAS_WORKSPACE_CONFIG unset",
    }


def _timed_run(ctx: Ctx, name: str, deterministic: bool, n_steps: int, batches=None):
    """((losses, params, seconds per step), batches) of `n_steps` timed steps after a warm-up;
    `batches` (n_steps + 1 of them) from this trainer's data unless given."""
    flag = f"distributed.deterministic={str(deterministic).lower()}"
    trainer = make_trainer(ctx, name, [*blt_argv(ctx), flag])
    try:
        if batches is None:
            batches = [trainer.next_batches() for _ in range(n_steps + 1)]
        trainer.train_step(batches[0])  # warm-up, timed steps after it
        ctx.sync()
        t0 = time.perf_counter()
        losses = [float(trainer.train_step(b).loss_sum) for b in batches[1:]]
        seconds = (time.perf_counter() - t0) / n_steps
        return (losses, _params(trainer.model), seconds), batches
    finally:
        trainer.close()


def _in_clean_child(ctx: Ctx, fn) -> Any:
    """`fn()` in a forked child without CUBLAS_WORKSPACE_CONFIG (its result comes back as JSON);
    call it before this process initialises CUDA (a forked child could not use it)."""
    import os

    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA initialised before forking a clean child")
    result = ctx.work / "clean_child.json"
    result.unlink(missing_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
            result.write_text(json.dumps(fn()))
            code = 0
        except BaseException:  # noqa: BLE001 - its traceback goes to the step's log
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    expect(rc == 0 and result.exists(), f"the clean child failed (exit code {rc}; see log.txt)")
    return json.loads(result.read_text())


def step_throughput(ctx: Ctx) -> dict:
    """Bytes/s of the debug BLT and the 100M entropy model, eager."""
    return _throughput(ctx, compiled=False)


def step_throughput_compiled(ctx: Ctx) -> dict:
    """The same with per-block torch.compile (not with --quick: inductor on CPU takes minutes)."""
    return _throughput(ctx, compiled=True)


def _throughput(ctx: Ctx, compiled: bool) -> dict:
    rows = []
    for model, argv in (("blt_debug", blt_argv(ctx)), ("entropy", entropy_argv(ctx))):
        flag = f"distributed.compile={str(compiled).lower()}"
        trainer = make_trainer(ctx, f"{model}_{compiled}", [*argv, flag])
        try:
            rows.append({"model": model, "n_params": trainer.n_params, **_time_steps(ctx, trainer)})
        finally:
            trainer.close()
    return {"compile": compiled, "rows": rows}


def _time_steps(ctx: Ctx, trainer, warmup: int = 2, steps: int | None = None) -> dict:
    """Bytes/s over `steps` steps after at least `warmup` ones, and after the last step in which
    dynamo compiled a frame (at most 8 warm-up steps): automatic dynamic shapes compile a block
    again when a size first changes, which fell inside the timed steps of the compiled entropy
    model (0.136 s/step, "slower than eager"; 0.077 s/step after 3 warm-up steps against 0.108
    eager: bench/gpu/compile_diag.py, 2026-12-04)."""
    from torch._dynamo.utils import counters

    steps = steps or (2 if ctx.quick else 10)
    t0 = time.perf_counter()
    done, compiling = 0, True
    while done < warmup or (compiling and done < 8):
        frames = counters["frames"]["ok"]
        trainer.train_step(trainer.next_batches())
        done, compiling = done + 1, counters["frames"]["ok"] != frames
    ctx.sync()
    warm_s = time.perf_counter() - t0
    batches = [trainer.next_batches() for _ in range(steps)]
    t0 = time.perf_counter()
    for b in batches:
        out = trainer.train_step(b)
    float(out.loss_sum)
    ctx.sync()
    seconds = time.perf_counter() - t0
    n_bytes = sum(int(x.x.size) for b in batches for x in b)
    return {
        "bytes_per_s": round(n_bytes / seconds, 1),
        "step_s": round(seconds / steps, 4),
        "warmup_s": round(warm_s, 2),
        "warmup_steps": done,
        "peak_mem_gib": _peak_mem(ctx),
    }


def _peak_mem(ctx: Ctx) -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if ctx.cuda else None


BLT_1B_QUICK = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.dim_local_encoder=32",
    "model.dim_local_decoder=32",
    "model.n_heads_local_encoder=2",
    "model.n_heads_local_decoder=2",
    "model.cross_attn_nheads=2",
    "model.n_layers_local_decoder=2",
    "model.encoder_hash_byte_group_vocab=1001",
    "data.seq_len=64",
    "model.max_seqlen=64",
    "data.max_encoder_seq_length=256",
    "model.max_encoder_seq_length=256",
]


def step_blt_1b(ctx: Ctx) -> dict:
    """BLT-1B (configs/blt_1b.yaml) at its own batch, without activation checkpointing unless
    it does not fit (then selective, said in the entry), entropy-like patch lengths; >= 2
    warm-up and >= 5 timed steps (CUDA events). MFU: the analytic model FLOPs of the real bytes
    and patches (the trainer's FlopsCounter, what `mfu` in metrics.jsonl is); HFU: what
    FlopCounterMode counts in one step (executed work: padding, recompute); both against a bf16
    matmul measured here (quick: fp32, tiny shapes)."""
    import torch

    matmul = _matmul_tflops(ctx)
    argv = ["config=configs/blt_1b.yaml", "data.preprocess_dir=null",
            "data.patcher_args.patching_mode=space", "distributed.single_device_fsdp=true"]  # fmt: skip
    argv += BLT_1B_QUICK if ctx.quick else []
    entry: dict[str, Any] = {"activation_checkpointing": "none"}
    try:
        entry |= _blt_1b_run(ctx, [*argv, "distributed.activation_checkpointing=none"], matmul)
    except torch.cuda.OutOfMemoryError as e:
        entry = {"activation_checkpointing": "selective", "oom_without_ac": str(e)[:160]}
        torch.cuda.empty_cache()
        argv.append("distributed.activation_checkpointing=selective")
        entry |= _blt_1b_run(ctx, argv, matmul)
    return entry


def _blt_1b_run(ctx: Ctx, argv: list[str], matmul: dict) -> dict:
    import torch

    from bytelatent.trainer.throughput import BatchSizes, FlopsCounter

    warmup, timed = (2, 5)
    trainer = make_trainer(ctx, "blt_1b", argv)
    try:
        mean_patch = trainer.args.data.max_encoder_seq_length / trainer.args.data.seq_len
        batches = [
            [entropy_like(b, mean_patch, seed=i) for b in trainer.next_batches()]
            for i in range(warmup + timed + 1)
        ]
        for b in batches[:warmup]:
            trainer.train_step(b)
        # timed first: a failure of the FLOP count below must not cost the MFU
        seconds = _timed_steps(ctx, trainer, batches[warmup + 1 :])
        try:
            counted, count_note = _counted_flops(trainer, batches[warmup]), None
        except Exception as e:  # noqa: BLE001 - HFU is the secondary number: say why it is missing
            counted, count_note = None, f"{type(e).__name__}: {str(e)[:300]}"
        flops = FlopsCounter(trainer.args)
        sizes = [BatchSizes.of(x) for b in batches[warmup + 1 :] for x in b]
        useful = sum(flops.useful(s) for s in sizes) / timed
        executed = sum(flops.executed(s) for s in sizes) / timed
        step_s = seconds / timed
        peak = matmul["tflops"] * 1e12
        real_bytes = sum(s.real_tokens for s in sizes)
        return {
            "n_params": trainer.n_params,
            "batch_size": trainer.args.data.batch_size,
            "bytes_per_row": int(batches[0][0].x.shape[1]),
            "mean_patch_bytes": round(real_bytes / sum(s.real_patches for s in sizes), 2),
            "warmup_steps": warmup,
            "timed_steps": timed,
            "step_s": round(step_s, 4),
            "real_bytes_per_s": round(real_bytes / seconds, 1),
            "padding_frac": round(1 - real_bytes / sum(s.tokens for s in sizes), 4),
            "model_flops_per_step": useful,
            "model_flops_per_step_padded": executed,
            "counted_flops_per_step": counted,
            **({"hfu_error": count_note} if count_note else {}),
            "matmul_tflops": matmul,
            "mfu": round(useful / step_s / peak, 4),
            "hfu": None if counted is None else round(counted / step_s / peak, 4),
            "peak_mem_gib": _peak_mem(ctx),
        }
    finally:
        trainer.close()
        del trainer
        if ctx.cuda:
            torch.cuda.empty_cache()


def _counted_flops(trainer, batches: list) -> float:
    """The FLOPs FlopCounterMode counts in one step, flex_attention's block-sparse work included.

    Under a dispatch mode dynamo does not compile, and torch 2.11's eager flex_attention fails
    under FlopCounterMode ("no implementation found for torch.ops.higher_order.flex_attention",
    the first GPU run): each flex call leaves the mode, runs compiled, and adds the work of the
    blocks it visits (4·D FLOPs per query-key pair per head forward, 2.5 times that backward)."""
    from torch.utils._python_dispatch import _disable_current_modes
    from torch.utils.flop_counter import FlopCounterMode

    from bytelatent.model.attention import flex

    real = flex._compiled_flex()
    flex_flops = [0.0]

    def counted_flex(q, k, v, block_mask):
        with _disable_current_modes():
            out = real(q, k, v, block_mask=block_mask)
        flex_flops[0] += flex_block_flops(q, block_mask) * (3.5 if q.requires_grad else 1.0)
        return out

    flex._flex_fn = counted_flex
    try:
        counter = FlopCounterMode(display=False)
        with counter:
            trainer.train_step(batches)
    finally:
        flex._flex_fn = real
    return counter.get_total_flops() + flex_flops[0]


def flex_block_flops(q, block_mask) -> float:
    """Forward FLOPs flex_attention executes for `q` [B, H, S, D]: every query-key pair of the
    blocks it visits (partial and full ones), 4·D per pair (QK^T and PV) and head."""
    visited = block_mask.kv_num_blocks.sum().item()
    if block_mask.full_kv_num_blocks is not None:
        visited += block_mask.full_kv_num_blocks.sum().item()
    q_block, kv_block = block_mask.BLOCK_SIZE
    b_mask, h_mask = block_mask.kv_num_blocks.shape[:2]
    broadcast = (q.shape[0] // b_mask) * (q.shape[1] // h_mask)
    return 4.0 * q.shape[-1] * visited * q_block * kv_block * broadcast


def _timed_steps(ctx: Ctx, trainer, batches: list) -> float:
    """Seconds of `batches`' steps: CUDA events around them on a GPU, else perf_counter."""
    import torch

    if not ctx.cuda:
        t0 = time.perf_counter()
        for b in batches:
            trainer.train_step(b)
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for b in batches:
        trainer.train_step(b)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000


def entropy_like(batch, mean: float, seed: int):
    """`batch` with patch lengths shaped like entropy patching's (the 1B is defined with it, and
    no entropy model is at hand): first patch 1, then geometric lengths of mean `mean` (many short
    patches, a long tail), each row summing to L + 1 within the batch's patch columns."""
    import numpy as np

    from bytelatent.data.batch import Batch

    rng = np.random.default_rng(seed)
    rows, length = batch.x.shape
    columns = batch.patch_lengths.shape[1]
    lengths = np.zeros((rows, columns), dtype=np.int64)
    for row in range(rows):
        draws = np.minimum(rng.geometric(1 / mean, size=columns - 1), 64)
        ends = np.cumsum(draws)
        n = min(columns - 1, int(np.searchsorted(ends, length)) + 1)
        draws = draws[:n]
        draws[-1] += length - draws.sum()  # the last patch closes the row (or takes the rest)
        if draws[-1] < 1:  # cannot happen when searchsorted cut at the row end; keep it exact
            raise CheckFailed("entropy_like: a row's patch lengths do not sum to L + 1")
        lengths[row, 0] = 1
        lengths[row, 1 : n + 1] = draws
    return Batch(batch.x, batch.y, batch.mask, lengths)


def _matmul_tflops(ctx: Ctx) -> dict:
    import torch

    n, dtype = (512, torch.float32) if ctx.quick else (8192, torch.bfloat16)
    a = torch.randn(n, n, device=ctx.device, dtype=dtype)
    b = torch.randn(n, n, device=ctx.device, dtype=dtype)
    for _ in range(3):
        a @ b
    ctx.sync()
    reps = 10
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    ctx.sync()
    seconds = (time.perf_counter() - t0) / reps
    return {"n": n, "dtype": str(dtype)[6:], "tflops": round(2 * n**3 / seconds / 1e12, 3)}


def step_profiler(ctx: Ctx) -> dict:
    """The profiler's trace (CUDA kernels on a GPU) and, on CUDA, the memory snapshot."""
    argv = [
        *blt_argv(ctx),
        "steps=4",
        "profiling.run=true",
        "profiling.start_step=2",
        "profiling.active_steps=2",
        "profiling.memory=true",
    ]
    trainer = make_trainer(ctx, "profiler", argv)
    try:
        trainer.train()
        folder = Path(trainer.args.dump_dir) / "profiling"
    finally:
        trainer.close()
    traces = sorted(folder.glob("trace_*.json"))
    expect(bool(traces), f"no trace written under {folder}")
    with open(traces[0], "rb") as src, gzip.open(ctx.out / "trace.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    events = json.loads(traces[0].read_text()).get("traceEvents", [])
    kernels = sum(1 for e in events if e.get("cat") == "kernel")
    entry = {
        "trace_events": len(events),
        "cuda_kernels": kernels,
        "trace_gz_bytes": (ctx.out / "trace.json.gz").stat().st_size,
    }
    if (ctx.out / "trace.json.gz").stat().st_size > MAX_FILE:
        (ctx.out / "trace.json.gz").unlink()
        entry["trace_gz_bytes"] = "too large to return; dropped"
    if ctx.cuda:
        expect(kernels > 0, "the CUDA trace has no kernel events")
        snaps = sorted(folder.glob("memory_snapshot_*.pickle"))
        expect(bool(snaps), "no memory snapshot written")
        entry["memory_snapshot_bytes"] = snaps[0].stat().st_size
        if snaps[0].stat().st_size <= MAX_FILE:
            shutil.copy(snaps[0], ctx.out / "memory_snapshot.pickle")
    return entry


def step_generation(ctx: Ctx) -> dict:
    """Generation bytes/s on this device and on CPU (random-init debug models: lm, blt cached,
    blt speculative k=3, hnet cached); on CUDA each device engine is run once more under
    `torch.cuda.set_sync_debug_mode("warn")` and every host sync it makes is listed as
    file:line with its count (per new byte in `syncs_per_byte`)."""
    sys.path.insert(0, str(REPO / "bench"))
    import generation_cpu as g

    from bytelatent.data.patcher import PatcherArgs
    from bytelatent.eval.generation import GenerationArgs, Generator

    n_new = 32 if ctx.quick else 256
    max_bytes = 512 if ctx.quick else 2048
    entropy = g.entropy_model(max_bytes)
    patcher = PatcherArgs(patching_mode="entropy", threshold=g.calibrated_threshold(entropy))
    blt, hnet = g.debug_blt(max_bytes), _generation_hnet(max_bytes)
    engines = {
        "lm": (lambda: Generator(entropy), {}),
        "blt": (lambda: Generator(blt, patcher, entropy), {}),
        "blt_spec3": (lambda: Generator(blt, patcher, entropy), {"speculative_k": 3}),
        "hnet": (lambda: Generator(hnet), {}),
    }
    rows: dict[str, Any] = {"new_bytes": n_new}
    for dev in ["cpu"] + (["cuda"] if ctx.cuda else []):
        for model in (entropy, blt, hnet):
            model.to(dev)
        for name, (make, extra) in engines.items():
            gen = make()
            args = GenerationArgs(max_new_bytes=n_new, stop_at_eos=False, **extra)
            gen.generate([g.PROMPT], args.model_copy(update={"max_new_bytes": 4}))
            ctx.sync()
            t0 = time.perf_counter()
            result = gen.generate([g.PROMPT], args)[0]
            ctx.sync()
            rows[f"{name}_{dev}_bytes_per_s"] = round(
                len(result.tokens) / (time.perf_counter() - t0), 1
            )
            if dev == "cuda":
                rows[f"{name}_syncs"] = _sync_sites(gen, [g.PROMPT], args)
    if not ctx.cuda:
        rows["syncs"] = "n/a on cpu (torch.cuda.set_sync_debug_mode needs CUDA)"
    return rows


def _generation_hnet(max_bytes: int):
    """A random-init one-stage H-Net sized like bench/generation_cpu.py's (no calibration)."""
    sys.path.insert(0, str(REPO / "bench"))
    import generation_cpu as g

    from bytelatent.archs.hnet.args import HNetArgs
    from bytelatent.archs.hnet.model import HNet

    stage = dict(dim=64, n_heads=4, n_layers_encoder=1, n_layers_decoder=1, sliding_window=64,
                 target_ratio=4.0)  # fmt: skip
    args = HNetArgs(stages=[stage], dim=128, n_layers=2, n_heads=4, max_seqlen=max_bytes,
                    multiple_of=64, rope_theta=5e5)  # fmt: skip
    return g.build(HNet, args, 2)


def _sync_sites(gen, prompts: list[str], args) -> dict:
    """Host syncs of `gen.generate(prompts, args)` (`host_syncs`): count, per new byte, and
    `file:line (op)` sites."""
    sites = host_syncs(lambda: gen.generate(prompts, args))
    total = sum(sites.values())
    n_new = len(prompts) * args.max_new_bytes
    return {
        "total": total,
        "per_byte": round(total / n_new, 2),
        "sites": dict(sites.most_common(16)),
    }


def step_hnet_flex(ctx: Ctx) -> dict:
    """H-Net (configs/hnet_debug.yaml) with flex attention over 12 steps of real data: its inner
    widths change with the routing, so this counts flex's compiles (a bounded number, each timed)
    and fails if flex ever runs uncompiled (CompileWatch: the recompile limit raises). On a GPU
    12 training steps; on CPU (flex has no CPU backward) 12 forwards, flex compiled with
    aot_eager and allowed on CPU for the forward."""
    import torch
    from torch._dynamo.utils import counters

    from bytelatent.archs.hnet.dc import chunking
    from bytelatent.model.attention import flex

    argv = ["config=configs/hnet_debug.yaml", "arch_args.attn_impl=flex_attention"]
    argv += ["data.batch_size=2", "data.seq_len=128"] if ctx.quick else []
    if not ctx.cuda:
        flex.FlexBackend.unavailable_reason = lambda self, device: None  # this forked child only
        flex._require_cuda = lambda q: None
        flex._flex_fn = flex.compile_flex("aot_eager")
    widths: list[int] = []
    original = chunking.padded_width

    def recording(num_tokens, limit: int) -> int:
        widths.append(original(num_tokens, limit))
        return widths[-1]

    chunking.padded_width = recording
    trainer = make_trainer(ctx, "hnet_flex", argv)
    graphs = counters["stats"]["unique_graphs"]
    steps, t0 = 12, time.perf_counter()
    try:
        with CompileWatch(limit=8) as watch:  # dynamo's default limit: what a run gets
            for i in range(steps):
                batches = trainer.next_batches()
                with watch.call(f"step {i}"):
                    if ctx.cuda:
                        trainer.train_step(batches)
                    else:
                        with torch.no_grad():
                            for b in batches:
                                trainer.model(torch.as_tensor(b.x))
    finally:
        chunking.padded_width = original
        trainer.close()
    compiled = counters["stats"]["unique_graphs"] - graphs
    expect(not watch.uncompiled, f"flex ran uncompiled: {watch.uncompiled[:3]}")
    expect(len(set(widths)) > 1, f"the chunk level kept one width {set(widths)}: nothing tested")
    return {
        "steps": steps,
        "mode": "train" if ctx.cuda else "forward (aot_eager, CPU)",
        "distinct_widths": len(set(widths)),
        "flex_graphs_compiled": compiled,
        "compiling_steps": watch.compiles,
        "seconds_total": round(time.perf_counter() - t0, 2),
    }
