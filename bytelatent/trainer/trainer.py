"""The training loop: one `Trainer` owns model, optimizer, data, checkpoints and metrics.

The loop (`train`) reads in one screen; each piece is a small method:
`next_batches` → `train_step` (→ `forward_backward` per micro-batch) → `log` → `maybe_save`.
"""

from __future__ import annotations

import gc
import logging
import os
import time

import torch
import torch.distributed as dist

from bytelatent.args import TrainArgs
from bytelatent.checkpoint.manager import CheckpointManager, parse_step
from bytelatent.config.redact import redacted_dump, redacted_yaml
from bytelatent.data.batch import Batch
from bytelatent.data.elastic import build_train_data, resume_data_state
from bytelatent.distributed.clip import clip_grad_norm_
from bytelatent.distributed.env import DistEnv
from bytelatent.distributed.faults import set_collective_timeouts
from bytelatent.distributed.mesh import build_mesh, dp_rank_and_size, tp_rank_and_size
from bytelatent.distributed.parallelize import (
    forward_context,
    init_model_weights,
    set_gradient_sync,
)
from bytelatent.distributed.signals import early_flag, requeue_slurm_job, under_slurm
from bytelatent.distributed.threads import trainer_cpu_threads
from bytelatent.eval.validate import Validator
from bytelatent.launch.async_eval import AsyncEvalLauncher
from bytelatent.model.loss import batch_losses
from bytelatent.model.registry import get_arch
from bytelatent.trainer.actions import NONFINITE_EXIT_CODE, Actions, Stop, with_nonfinite_stop
from bytelatent.trainer.build import build_parallel_model, warm_start_from_spec
from bytelatent.trainer.distill_loss import build_extra_losses
from bytelatent.trainer.guard import NonFiniteGuard
from bytelatent.trainer.interval import IntervalMetrics, StepOutput
from bytelatent.trainer.loop_controls import resolve_stop_step
from bytelatent.trainer.metrics import MetricLogger
from bytelatent.trainer.model_info import write_model_info
from bytelatent.trainer.optim import build_optimizer
from bytelatent.trainer.probe import build_probe
from bytelatent.trainer.profiling import build_profiler
from bytelatent.trainer.resume_check import complete_line
from bytelatent.trainer.resume_rules import apply_skip_bad_records, apply_source_weights
from bytelatent.trainer.run_files import (
    REPLAYED_METRICS,
    raise_log_file_error,
    set_aside_lines_after,
    write_text_atomic,
)
from bytelatent.trainer.state import (
    TrainState,
    capture_rng_state,
    read_data_states,
    restore_rng_state,
)

logger = logging.getLogger("bytelatent")


class Trainer:
    def __init__(self, args: TrainArgs, env: DistEnv):
        init_start = time.perf_counter()
        # The process's flag, installed by the entry's first line: a signal while we build and
        # restore is kept, and the run stops at the first boundary (`train`).
        self.preemption = early_flag()
        self.args = args
        self.env = env
        self.device = env.device
        torch.manual_seed(args.seed)
        if self.device.type == "cpu" and (threads := trainer_cpu_threads(
            args.num_threads, env.world_size, int(args.data.load_async)
        )):  # fmt: skip
            torch.set_num_threads(threads)
        self.mesh = build_mesh(args.distributed, env.world_size, self.device.type)
        # loss terms from the logits outside the model (a frozen teacher: the `distill` section)
        self.logit_terms = build_extra_losses(args, self.device)
        self.aux_terms = (  # logged as aux/<name>, apart from bpb
            *get_arch(args.arch).aux_losses, *(term.spec for term in self.logit_terms)
        )  # fmt: skip
        self.dp_rank, self.dp_size = dp_rank_and_size(self.mesh)
        self._dp_group_cache = None
        # Small per-step agreements (target counts, the preemption flag) use CPU tensors: on CUDA a
        # separate gloo group keeps them off the GPU stream, so the hot path never waits for it.
        self._host_group = (
            dist.new_group(backend="gloo")
            if self.mesh is not None and self.device.type == "cuda"
            else None
        )
        # Validation data is resolved now: a missing source fails before anything is built.
        self.validator = Validator.for_training(args, env, self.mesh, self.dp_rank, self.dp_size)
        self._phase(f"building the {args.arch} model")
        self.model = self._build_model()
        self.optimizer, self.scheduler = build_optimizer(
            self.model, args.optim, args.steps, self.device.type
        )
        self.checkpoints = CheckpointManager(
            args.checkpoint,
            dump_dir=args.dump_dir,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            is_tp_rank0=tp_rank_and_size(self.mesh)[0] == 0,
        )
        self.tokenizer = args.data.tokenizer_args.build()
        self.state = TrainState()
        self.actions = Actions.build(
            with_nonfinite_stop(args.actions, args.optim.max_skipped_steps)
        )
        if (arch_actions := get_arch(args.arch).actions) is not None:
            for action in arch_actions(args, env.rank):  # e.g. H-Net's router collapse warning
                self.actions.add(action)
        self.guard = NonFiniteGuard(self.optimizer, self.device)  # skips non-finite updates
        self.exit_code = 0  # set by an action that stops the run with an error
        self._resume_or_warm_start()
        self.stop_step = resolve_stop_step(args, self.state)
        # Launches an eval job on every complete eval save, and those a previous run still owes.
        self.async_evals = AsyncEvalLauncher.for_training(args, env.rank, self.checkpoints)
        self.async_evals.launch_owed()
        self._phase("starting the data loader")
        self.data = build_train_data(  # virtual streams: bytelatent/data/elastic.py
            args.data, self.dp_rank, self.dp_size, args.grad_acc_steps, self.state.data_state
        )
        if env.rank == 0:  # also at step 0: an attempt that died before its first save
            self._set_aside_replayed_metrics()
        config = {**redacted_dump(args), "n_params": self.n_params}
        self.metrics = MetricLogger.build(
            args.logging, args.dump_dir, env.rank, args.name, config, start_step=self.state.step,
            health=get_arch(args.arch).aux_metrics,  # the architecture's own numbers, on the console
        )  # fmt: skip
        self.metrics.set_summary({"n_params": self.n_params})
        self.interval = IntervalMetrics.for_run(args, env, self.dp_size, self._dp_group)
        self.timings = self.interval.timings  # eval and saves add `with self.timings.measure(...)`
        self.profiler = build_profiler(args.profiling, args.dump_dir, env.rank, self.device)
        self.probe = build_probe(self.model, args.probe_freq, args.dump_dir, env.rank)
        self.last: dict | None = None  # the last logged metrics
        self._last_saved_step = self.state.step if self.state.step > 0 else -1
        self._steps_run = 0  # optimizer steps taken by this process
        self.timings.record("init_or_restore_s", time.perf_counter() - init_start)

    # ---------------------------------------------------------------- setup
    def _build_model(self) -> torch.nn.Module:
        model = build_parallel_model(self.args, self.mesh)
        self.n_params = sum(p.numel() for p in model.parameters())  # global counts (DTensor)
        if self.env.rank == 0:
            write_model_info(model, self.args, self.mesh, self.env.rank)
        model.to_empty(device=self.device)
        init_model_weights(model, seed=self.args.active_model_args().seed)
        model.train()
        return model

    def _phase(self, what: str) -> None:
        """Say what start-up does next (rank 0), so a slow phase is never a silent one."""
        if self.env.rank == 0:
            logger.info("%s ...", what)

    def _resume_or_warm_start(self) -> None:
        path = self.checkpoints.resume_path()
        if path is not None:
            self._phase(f"restoring step {parse_step(path)} from {path}")
            self.scheduler.prepare_resume(parse_step(path))  # frozen groups have no AdamW state
            train_state = self.checkpoints.load(self.model, self.optimizer, path)
            path = self.checkpoints.last_load.path  # an older one if `path` failed its CRC32s
            self.state = TrainState.model_validate(train_state)
            # another dp size: every virtual data stream continues on its new rank
            saved_dp_size = self.checkpoints.last_load.saved_dp_size or self.dp_size
            self.state.data_state = resume_data_state(
                self.args.data, path, self.state.data_state, saved_dp_size,
                lambda: read_data_states(self.checkpoints.fs, path, saved_dp_size),
                self.dp_rank, self.dp_size, self.args.grad_acc_steps,
            )  # fmt: skip
            # the config's mixture on the resumed streams (resume_check refused a new source and
            # its "config differs" line says the weights are applied)
            self.state.data_state, _ = apply_source_weights(
                self.state.data_state, self.args.data.source_weights()
            )
            self.state.data_state = apply_skip_bad_records(
                self.state.data_state, self.args.data.skip_bad_records
            )
            self.scheduler.load_state_dict(self.state.scheduler)  # + the config's lr, AdamW values
            self.actions.load_state_dict(self.state.actions)
            self.actions.note_resume(path, self.state.step)
            restore_rng_state(self.state.rng)
            logger.info("resumed from %s at step %d", path, self.state.step)
        elif self.args.checkpoint.init_ckpt_path:
            ckpt = self.args.checkpoint
            self.checkpoints.load_init(
                self.model, ckpt.init_ckpt_path, ckpt.init_ckpt_strict, ckpt.init_ckpt_rename
            )
            logger.info("initialised model weights from %s", ckpt.init_ckpt_path)
        else:
            warm_start_from_spec(self.model, self.args)  # e.g. the BLT's model.global_init

    def _set_aside_replayed_metrics(self) -> None:
        """A resume from a checkpoint older than the last logged step logs those steps again:
        their old records move to metrics.replayed.jsonl, so metrics.jsonl has one per step."""
        aside = os.path.join(self.args.dump_dir, REPLAYED_METRICS)
        moved = set_aside_lines_after(
            os.path.join(self.args.dump_dir, "metrics.jsonl"), self.state.step, aside
        )
        if moved:
            before = (
                "this resume"
                if self.state.step
                else "this start: an earlier attempt saved no checkpoint"
            )
            logger.info(
                "metrics.jsonl: %d records after step %d (logged before %s) moved to %s",
                moved, self.state.step, before, aside,
            )  # fmt: skip

    # ---------------------------------------------------------------- loop
    def train(self) -> dict | None:
        """Train until `stop_step` or preemption; returns the last logged metrics."""
        if not self._ready_to_train():
            return self.last
        while self.state.step < self.stop_step:
            t0 = time.perf_counter()
            self.probe.begin(self.state.step + 1)
            batches = self.next_batches()
            data_time = time.perf_counter() - t0
            self.interval.clock.start()
            out = self.train_step(batches)
            self.interval.clock.stop()
            self.state.step += 1
            self.state.tokens_seen += out.n_bytes
            self.interval.add(out, batches, data_time)
            self._after_step(time.perf_counter() - t0)
            step = self.state.step
            if step % self.args.logging.freq == 0 or step == self.stop_step:
                if self.stopped(self.actions.run(step, self.log(out))):
                    return self.last
            if self.validator.should_run(step) and self.stopped(self.evaluate("loop")):
                return self.last
            self.async_evals.poll()
            if self.preempted():
                return self.last
            self.maybe_save()
        self.save("final")
        self.checkpoints.wait()
        if self.env.rank == 0:
            logger.info("%s", self.finished_line())
        return self.last

    def _ready_to_train(self) -> bool:
        """Before the first step: nothing to do, a signal during start-up, or an evaluation that
        stops the run end it here (False); otherwise config.yaml is written and the clock runs."""
        if self.state.step >= self.stop_step:  # resume_check looked at a save that failed to verify
            logger.info(complete_line(self.args, self.state.step))
            return False  # config.yaml stays the one of the run that trained
        if self.preempted():  # a signal while the run started up
            return False
        if self.env.rank == 0:  # secret-looking values (tokens, keys, passwords) redacted
            write_text_atomic(
                os.path.join(self.args.dump_dir, "config.yaml"), redacted_yaml(self.args)
            )
        if self.args.gc_collect_freq > 0:
            gc.disable()
        self.interval.start()
        if self.validator.should_run_before_training(self.state.step):
            return not self.stopped(self.evaluate("before_training"))
        return True

    def preempted(self) -> bool:
        """Whether any rank received a preemption signal (one all-reduce); if so, handled."""
        if not self.preemption.agreed(torch.device("cpu"), self._host_group):
            return False
        self.handle_preemption()
        return True

    def finished_line(self) -> str:
        """The run's last line: steps, the last logged loss and bpb, where its checkpoint is."""
        last = self.last or {}
        numbers = "".join(
            f", {key} {last[key]:.4f}"
            for key in ("loss", "bpb")
            if isinstance(last.get(key), float)
        )
        saved = self.checkpoints.step_folder(self.state.step)
        where = saved if self._last_saved_step == self.state.step else "no final checkpoint"
        return (
            f"done: {self.state.step} steps ({self._steps_run} in this process){numbers}; "
            f"checkpoint {where}"
        )

    def _after_step(self, seconds: float) -> None:
        """Per-step chores outside the hot path: GC, probe write-out, profiler window, timings."""
        self._steps_run += 1
        if self._steps_run == 1:
            self.timings.record("first_step_s", seconds)  # compilation and warm-up
            set_collective_timeouts(self.args.distributed.timeout_s)  # from first_step_timeout_s
        if self.args.gc_collect_freq > 0 and self.state.step % self.args.gc_collect_freq == 0:
            gc.collect()
        self.probe.end()
        self.profiler.step_done()

    def evaluate(self, mode: str) -> Stop | None:
        """Validate the current model (all ranks); the actions see the eval metrics."""
        with self.timings.measure("eval_s"):
            eval_metrics = self.validator.run(self.model, self.state.step, mode=mode)
        self.metrics.log_external(eval_metrics)  # metrics.eval.jsonl is the validator's; wandb too
        return self.actions.run(self.state.step, eval_metrics)

    def next_batches(self) -> list[Batch]:
        return [next(self.data) for _ in range(self.args.grad_acc_steps)]

    def train_step(self, batches: list[Batch]) -> StepOutput:
        """One optimizer step over `grad_acc_steps` micro-batches; clipping happens once."""
        local_targets = sum(
            int(b.target_mask.sum()) for b in batches
        )  # host-side numpy, no device sync
        global_targets = self._all_reduce_count(local_targets)
        # FSDP averages gradients over data-parallel ranks, so scale by dp_size: the update is then
        # Σ_all ranks CE / Σ_all ranks targets, independent of how targets fall on ranks and micro-batches.
        scale = self.dp_size / max(global_targets, 1)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        aux_sums: dict[str, torch.Tensor] = {}
        for i, batch in enumerate(batches):
            set_gradient_sync(self.model, i == len(batches) - 1)
            ce_sum, aux = self.forward_backward(batch, scale)
            loss_sum += ce_sum
            for name, value in aux.items():
                aux_sums[name] = aux_sums.get(name, 0.0) + value
        self.probe.record_grads()  # a no-op unless this step is probed
        grad_norm = clip_grad_norm_(self.model.parameters(), self.args.optim.clip)
        self.guard.step(loss_sum, grad_norm)  # optimizer.step() unless loss/grad norm non-finite
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        n_bytes = sum(self.tokenizer.n_bytes(b.y, b.target_mask) for b in batches)
        return StepOutput(
            loss_sum=loss_sum, n_targets=local_targets, n_bytes=n_bytes, grad_norm=grad_norm,
            aux_sums=aux_sums, n_micro_batches=len(batches),
        )  # fmt: skip

    def forward_backward(
        self, batch: Batch, scale: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward and backward of one micro-batch: (Σ CE, {aux loss name: value}), detached.

        The objective is the LM loss (Σ CE · scale) plus each auxiliary term of the architecture
        (`ArchSpec.aux_losses`, a per-micro-batch mean) weighted and divided by the micro-batches:
        FSDP's average over data-parallel ranks then makes it the mean over all micro-batches."""
        context = forward_context(self.mesh, self.args.distributed, self.device.type)
        loss_sum, aux = batch_losses(self.model, batch, self.device, context, self.logit_terms)
        objective = loss_sum * scale
        for term in self.aux_terms:
            objective = objective + aux[term.name] * (term.weight / self.args.grad_acc_steps)
        objective.backward()
        return loss_sum.detach().double(), {n: v.detach().double() for n, v in aux.items()}

    def _all_reduce_count(self, n: int) -> int:
        """Σ over data-parallel ranks of a host-side count, without syncing the device stream."""
        if self.dp_size == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64)  # CPU tensor over a gloo group: no GPU sync
        dist.all_reduce(t, group=self._host_group)
        # Every rank of a tensor-parallel group holds the same batch, so the world sum counts it tp times.
        return int(t.item()) // tp_rank_and_size(self.mesh)[1]

    def _dp_group(self):
        if self._dp_group_cache is None:
            self._dp_group_cache = self.mesh["dp_replicate", "dp_shard"]._flatten("dp").get_group()
        return self._dp_group_cache

    # ---------------------------------------------------------------- metrics
    def log(self, out: StepOutput) -> dict:
        """Close the log interval: the metric record, to every sink; returned for the actions."""
        self.last = self.interval.compute(
            self.state.step,
            **self.scheduler.lr_metrics(self.args.optim.lr),
            grad_norm=float(out.grad_norm),
            tokens_seen=self.state.tokens_seen,
            **self.guard.read(),
        )
        self.actions.observe(self.state.step, self.last)  # events into this step's record
        self.metrics.log(self.last)
        raise_log_file_error()  # train.log could not be written: end the run with that line
        return self.last

    # ---------------------------------------------------------------- checkpoints
    def maybe_save(self) -> None:
        step = self.state.step
        ckpt = self.args.checkpoint
        kinds = [
            k
            for k, rule in (("dump", ckpt.dump), ("eval", ckpt.eval))
            if rule.every and step % rule.every == 0
        ]
        if step in ckpt.steps:
            kinds.append("step")  # an explicit checkpoint.steps entry: kept by retention
        if kinds:
            self.save(kinds)

    def save(self, kind: str | list[str]) -> None:
        """The one save path: periodic, eval, preemption and final saves all come through here."""
        if self._last_saved_step == self.state.step:
            return
        final = "final" in ([kind] if isinstance(kind, str) else kind)
        if not self.guard.safe_to_save(self.model, self.state.step, final=final):
            if final and self.exit_code == 0:  # the run's result was not written: not a success
                self.exit_code = NONFINITE_EXIT_CODE
            return  # never write non-finite weights: retention would push out the last good one
        self.state.data_state = self.data.get_state().model_dump(mode="json")
        self.state.scheduler = self.scheduler.state_dict()
        self.state.rng = capture_rng_state()
        self.state.actions = self.actions.state_dict()
        with self.timings.measure("checkpoint_save_s"):
            self.checkpoints.save(
                self.state.step,
                self.model,
                self.optimizer,
                train_state=self.state.model_dump(mode="json"),
                params=redacted_dump(self.args),  # checkpoints get shared: no secrets
                kind=kind,
            )
        self._last_saved_step = self.state.step

    def stopped(self, stop: Stop | None) -> bool:
        """End the run if an action asked to (saving unless told not to); True when it ended."""
        if stop is None:
            return False
        (logger.info if stop.exit_code == 0 else logger.error)("%s", stop.reason)
        self.exit_code = stop.exit_code
        if stop.save:
            self.save("final")
        self.checkpoints.wait()
        return True

    def handle_preemption(self) -> None:
        """Save (when this process trained a step since the last save), then requeue or stop.
        A Ctrl-C is a preemption that says so in one line (`_interrupted_line`)."""
        saving = self._last_saved_step != self.state.step and self.state.step > 0
        if self.preemption.interactive:
            if saving:
                self.save("preempt")
                self.checkpoints.wait()
            if self.env.rank == 0:
                logger.info("%s", self._interrupted_line(saving))
            return
        if saving:
            logger.info("preemption: saving at step %d", self.state.step)
            self.save("preempt")
            self.checkpoints.wait()
        else:
            logger.info("preemption at step %d: nothing new to save", self.state.step)
        if under_slurm() and requeue_slurm_job(self.env.rank == 0):
            return
        if self.env.rank == 0:
            logger.info(
                "stopped at step %d; run the same command again to resume from %s",
                self.state.step,
                self.args.checkpoint.path,
            )

    def _interrupted_line(self, saved: bool) -> str:
        step = self.state.step
        if saved:
            what = f"saved step {step}"
        elif step > 0:
            what = f"step {step} was saved already"
        else:
            return "Ctrl-C before the first step: nothing to save"
        return f"Ctrl-C at step {step}: {what}; run the same command again to resume"

    def close(self, exit_code: int = 0) -> None:
        self.preemption.uninstall()
        self.profiler.close()
        self.metrics.close(exit_code)
        self.checkpoints.close()
        self.async_evals.close()
        close = getattr(self.data, "close", None) or getattr(self.data, "shutdown", None)
        if close is not None:
            close()
        gc.enable()
