"""lm-evaluation-harness adapter for our checkpoints (entropy model / byte LM, and BLT).

    python -m bytelatent.eval.harness ckpt=DIR tasks=[name,...] include_path=DIR output=results.json
        [limit=N] [num_fewshot=K] [batch_size=8] [entropy_ckpt=DIR] [device=cpu]
        [patcher.threshold=...]

Requests are scored on bytes: a context is ``[BOS] + bytes``; ``loglikelihood`` sums the
log-probabilities of the continuation's bytes, computed in float32 from the model's logits. A BLT
sees the whole context + continuation patched as in training (the patcher on the full token
sequence, the input is all tokens but the last). Sequences longer than the model keep their end.
``loglikelihood_rolling`` uses lm-eval's disjoint rolling windows; ``generate_until`` runs the
cached generator ``batch_size`` requests at a time (requests with the same generation kwargs,
longest contexts first; answers in request order). ``run_harness`` is the entry point for other
code (e.g. the eval system).
"""

from __future__ import annotations

import difflib
import json
import logging
import sys
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from bytelatent.checkpoint.pretrained import load_entropy_checkpoint
from bytelatent.config.help import entry_help
from bytelatent.config.parser import parse_args
from bytelatent.data.chat import (
    END_ID,
    TEMPLATE_NAME,
    answer_of,
    has_markers,
    render_chat,
    text_tokens,
)
from bytelatent.data.patcher import Patcher, PatcherArgs, PatchingMode
from bytelatent.errors import ConfigError, UserError
from bytelatent.eval.generation import (
    GenerationArgs,
    Generator,
    encode_prompt,
    load_generator,
)
from bytelatent.eval.generation.engines import model_spec
from bytelatent.eval.tasks import register_task
from bytelatent.model.patch_lengths import first_token_alone
from bytelatent.model.registry import arch_of
from bytelatent.tokenizers.constants import BOS_ID

try:
    from lm_eval.api.model import LM
except ImportError:  # the adapter needs the `eval` extra; the rest of the package does not
    LM = object  # type: ignore[misc,assignment]

logger = logging.getLogger("bytelatent")


def _byte_tokens(text: str) -> list[int]:
    """Byte ids; chat-template markers in text form (`apply_chat_template`) become their ids."""
    return text_tokens(text)


class BytelatentLM(LM):
    """An ``lm_eval`` model over a loaded LMTransformer or ByteLatentTransformer."""

    def __init__(
        self,
        model: nn.Module,
        patcher_args: PatcherArgs | None = None,
        entropy_model: nn.Module | None = None,
        show_progress: bool = False,
        batch_size: int = 8,
    ) -> None:
        if LM is object:
            raise ConfigError("the lm-eval adapter needs lm_eval: pip install 'bytelatent[eval]'")
        if batch_size < 1:
            raise ConfigError(f"batch_size: must be at least 1, got {batch_size}")
        super().__init__()
        self.batch_size = batch_size
        self.generator = Generator(model, patcher_args, entropy_model)
        self.model = self.generator.model
        self.patcher = None
        if self.generator.is_blt:
            args = patcher_args.model_copy(update={"realtime_patching": False})
            self.patcher = Patcher(args, entropy_model=entropy_model)
        self.device_ = next(model.parameters()).device
        self.show_progress = show_progress

    @property
    def max_tokens(self) -> int:
        return self.generator.max_tokens

    @property
    def tokenizer_name(self) -> str:
        """lm-eval caches chat-templated requests by this name."""
        return TEMPLATE_NAME

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The training template (data/chat.py) in text form; `_byte_tokens` maps it back."""
        turns = [(m["role"], m["content"]) for m in chat_history]
        return render_chat(turns, add_generation_prompt)

    @torch.no_grad()
    def token_logprobs(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """log p(tokens[i+1] | tokens[:i+1]) [len - 1] float32, and whether each is the argmax."""
        full = torch.tensor([tokens], dtype=torch.long, device=self.device_)
        inputs = full[:, :-1]
        if self.patcher is None:
            out = self.model(inputs)
        else:
            lengths, _ = self.patcher.patch(full, include_next_token=False)
            out = self.model(inputs, first_token_alone(lengths))  # as in training
        logits = model_spec(self.model).logits(out)  # H-Net's forward also returns its aux
        log_probs = F.log_softmax(logits[0].float(), dim=-1)
        return log_probs.gather(1, full[0, 1:, None])[:, 0], log_probs.argmax(-1) == full[0, 1:]

    def score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """(sum of log-probs of ``continuation`` after ``context``, whether it is the greedy one)."""
        if not continuation:
            return 0.0, True
        tokens = (context + continuation)[-(self.max_tokens + 1) :]  # keep the end
        log_probs, greedy = self.token_logprobs(tokens)
        n = len(continuation)
        return float(log_probs[-n:].double().sum()), bool(greedy[-n:].all())

    def _progress(self, items, what: str):
        if not self.show_progress:
            return items
        from tqdm import tqdm

        return tqdm(items, desc=what, file=sys.stderr)

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        out = []
        for request in self._progress(requests, "loglikelihood"):
            context, continuation = request.args
            out.append(self.score(encode_prompt(context), _byte_tokens(continuation)))
        return out

    def loglikelihood_rolling(self, requests) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for request in self._progress(requests, "loglikelihood_rolling"):
            (text,) = request.args
            windows = get_rolling_token_windows(
                token_list=_byte_tokens(text),
                prefix_token=BOS_ID,
                max_seq_len=self.max_tokens,
                context_len=1,
            )
            total = 0.0
            for window in windows:
                context, predicted = make_disjoint_window(window)
                total += self.score(context, predicted)[0]
            out.append(total)
        return out

    def generate_until(self, requests) -> list[str]:
        """Continuations, ``batch_size`` requests per generator call; a row's text does not
        depend on its batch (`Generator`), so batching changes only the speed."""
        out: list[str] = [""] * len(requests)
        for indices in self._progress(self.generation_batches(requests), "generate_until"):
            args = generation_args_from_lm_eval(requests[indices[0]].args[1])
            args = args.model_copy(update={"batch_size": len(indices)})
            contexts = [requests[i].args[0] for i in indices]
            if any(has_markers(c) for c in contexts):  # chat-templated: stop at the turn's end
                out_texts = self._chat_answers(contexts, args)
            else:
                results = self.generator.generate(contexts, args, truncate=True, allow_empty=True)
                out_texts = [result.text for result in results]
            for i, text in zip(indices, out_texts, strict=True):
                out[i] = text
        return out

    def _chat_answers(self, contexts: list[str], args: GenerationArgs) -> list[str]:
        """Answers to chat-templated contexts: the bytes before the end-of-turn marker."""
        keep = self.max_tokens - 2
        rows = [[BOS_ID, *_byte_tokens(c)[-keep:]] for c in contexts]  # keep BOS and the end
        args = args.model_copy(update={"stop_ids": sorted({*args.stop_ids, END_ID})})
        results = self.generator.generate_tokens(rows, args)
        return [answer_of(r.tokens)[0].decode("utf-8", errors="replace") for r in results]

    def generation_batches(self, requests) -> list[list[int]]:
        """Request indices in batches of at most ``batch_size`` that share generation kwargs,
        each group sorted by context length, longest first (lm-eval's order: rows of a batch
        pad little, and the first batch is the largest)."""
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            key = json.dumps(request.args[1] or {}, sort_keys=True, default=str)
            groups.setdefault(key, []).append(index)
        batches = []
        for indices in groups.values():
            indices.sort(key=lambda i: -len(requests[i].args[0].encode("utf-8")))
            for first in range(0, len(indices), self.batch_size):
                batches.append(indices[first : first + self.batch_size])
        return batches


def generation_args_from_lm_eval(gen_kwargs: dict[str, Any]) -> GenerationArgs:
    """lm-eval's generation kwargs (until, max_gen_toks, temperature, do_sample, ...)."""
    kwargs = dict(gen_kwargs or {})
    until = kwargs.pop("until", None) or []
    until = [until] if isinstance(until, str) else list(until)
    temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
    if not kwargs.pop("do_sample", temperature > 0):
        temperature = 0.0
    top_k = kwargs.pop("top_k", None)
    top_p = kwargs.pop("top_p", None)
    return GenerationArgs(
        max_new_bytes=int(kwargs.pop("max_gen_toks", 256)),
        temperature=temperature,
        top_k=int(top_k) if top_k else None,
        top_p=float(top_p) if top_p is not None and float(top_p) < 1.0 else None,
        seed=int(kwargs.pop("seed", 0)),
        stop=[s for s in until if s],
        speculative_k=int(kwargs.pop("speculative_k", 0)),  # BLT self-speculative decoding
    )


def check_tasks(tasks: list[str], task_manager) -> None:
    known = set(task_manager.all_tasks)
    for name in tasks:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f" (did you mean {close[0]}?)" if close else " (check include_path)"
            raise ConfigError(f"tasks: unknown task {name!r}{hint}")


def run_harness(
    model: nn.Module,
    tasks: list[str],
    include_path: str | list[str] | None = None,
    limit: int | float | None = None,
    *,
    patcher_args: PatcherArgs | None = None,
    entropy_model: nn.Module | None = None,
    num_fewshot: int | None = None,
    bootstrap_iters: int = 0,
    include_defaults: bool = True,
    show_progress: bool = False,
    batch_size: int = 8,
    **evaluate_kwargs: Any,
) -> dict[str, Any]:
    """Run lm-eval ``tasks`` on a loaded model; returns lm-eval's results dict (JSON-able)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    if not tasks:
        raise ConfigError("tasks: give at least one task name")
    manager = TaskManager(include_path=include_path, include_defaults=include_defaults)
    check_tasks(tasks, manager)
    lm = BytelatentLM(model, patcher_args, entropy_model, show_progress, batch_size)
    results = simple_evaluate(
        model=lm,
        tasks=list(tasks),
        task_manager=manager,
        limit=limit,
        num_fewshot=num_fewshot,
        bootstrap_iters=bootstrap_iters,
        log_samples=False,
        **evaluate_kwargs,
    )
    return json.loads(json.dumps(results, default=str))


class HarnessArgs(BaseModel):
    """CLI arguments of ``python -m bytelatent.eval.harness``."""

    model_config = ConfigDict(extra="forbid")

    ckpt: str = Field(
        ..., description="DCP step folder, consolidated folder or released-layout folder"
    )
    tasks: list[str] = Field(min_length=1, description="lm-eval task names, e.g. [hellaswag]")
    include_path: str | None = Field(None, description="folder of extra lm-eval task YAMLs")
    output: str | None = Field(None, description="write lm-eval's results JSON here")
    limit: int | float | None = Field(
        None, description="documents per task: a count, or a fraction < 1; null: all"
    )
    num_fewshot: int | None = Field(None, description="few-shot examples; null: the task's")
    batch_size: int = Field(8, ge=1, description="generate_until requests generated together")
    bootstrap_iters: int = Field(
        0, description="bootstrap resamples for standard errors; 0: none (fast)"
    )
    include_defaults: bool = Field(True, description="also offer lm-eval's built-in tasks")
    entropy_ckpt: str | None = Field(
        None,
        description="entropy model for entropy patching; default: the checkpoint's "
        "entropy_model_checkpoint_dir or a sibling entropy_model/",
    )
    patcher: dict[str, Any] = Field(
        {}, description="patcher_args overrides over the checkpoint's, e.g. patcher.threshold=3"
    )
    device: str = Field("cpu", description="torch device, e.g. cpu, cuda, cuda:1")
    progress: bool | None = Field(None, description="tqdm progress bars; null: only on a terminal")
    allow_arch_import: bool = Field(
        False,
        description="import the module an arch 'pkg.module:name' in the checkpoint's params.json "
        "names (runs its code: only for a checkpoint you trust)",
    )


def run(args: HarnessArgs) -> dict[str, Any]:
    from lm_eval.tasks import TaskManager

    # unknown task names fail before the checkpoint is loaded
    manager = TaskManager(include_path=args.include_path, include_defaults=args.include_defaults)
    check_tasks(args.tasks, manager)
    gen = load_generator(
        args.ckpt, args.device, args.entropy_ckpt, args.patcher or None,
        allow_arch_import=args.allow_arch_import,
    )  # fmt: skip
    results = run_harness(
        gen.model,
        args.tasks,
        args.include_path,
        args.limit,
        patcher_args=gen.patcher_args,
        entropy_model=gen.entropy_model,
        num_fewshot=args.num_fewshot,
        bootstrap_iters=args.bootstrap_iters,
        include_defaults=args.include_defaults,
        show_progress=sys.stderr.isatty() if args.progress is None else args.progress,
        batch_size=args.batch_size,
    )
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)
    return results


HARNESS_USAGE = "usage: python -m bytelatent.eval.harness ckpt=DIR tasks=[name,...] [key=value ...]"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if (
            page := entry_help(argv, usage=HARNESS_USAGE, model=HarnessArgs, doc=__doc__)
        ) is not None:
            print(page, end="")
            return 0
        args = parse_args(HarnessArgs, argv)
        results = run(args)
    except UserError as exc:
        print(exc.one_line(), file=sys.stderr)
        return 2
    for task, metrics in results.get("results", {}).items():
        shown = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        print(f"{task}: {json.dumps(shown)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


# ---------------------------------------------------------------- as an eval task (eval.tasks)
class HarnessTaskArgs(BaseModel):
    """`eval.task_args.harness`: the lm-eval tasks an evaluation runs on the checkpoint."""

    model_config = ConfigDict(extra="forbid")

    tasks: list[str] = Field(min_length=1, description="lm-eval task names, e.g. [hellaswag]")
    include_path: str | None = Field(None, description="folder of extra lm-eval task YAMLs")
    include_defaults: bool = Field(True, description="also offer lm-eval's built-in tasks")
    limit: int | float | None = Field(
        None, description="documents per task: a count, or a fraction < 1; null: all"
    )
    num_fewshot: int | None = Field(None, description="few-shot examples; null: the task's")
    batch_size: int = Field(8, ge=1, description="generate_until requests generated together")


def _numeric_results(results: dict[str, Any]) -> dict[str, float]:
    """lm-eval's {task: {"acc,none": x, ...}} as flat `harness/<task>/<metric>` numbers."""
    flat = {}
    for task, metrics in results.get("results", {}).items():
        for name, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                flat[f"harness/{task}/{name.replace(',none', '')}"] = float(value)
    return flat


def harness_eval_task(ctx) -> dict[str, float]:
    """The `harness` eval task: every rank runs the same requests (an FSDP model needs all ranks
    in every forward); the BLT is patched with the run's `data.patcher_args`."""
    if LM is object:
        raise ConfigError("eval.tasks: 'harness' needs lm_eval: pip install 'bytelatent[eval]'")
    args: HarnessTaskArgs = ctx.task_args
    patcher_args, entropy_model = None, None
    spec = arch_of(ctx.model)
    if spec is not None and spec.patched:  # the BLT: patched as the run's data is
        patcher_args = ctx.data_args.patcher_args.model_copy(
            update={"patching_device": "auto", "device": "auto", "realtime_patching": False}
        )
        if patcher_args.patching_mode in (PatchingMode.entropy, PatchingMode.bpe_patcher):
            where = patcher_args.entropy_model_checkpoint_dir
            if not where:
                raise ConfigError(
                    "eval.tasks: 'harness' on an entropy-patched BLT needs "
                    "data.patcher_args.entropy_model_checkpoint_dir"
                )
            entropy_model = load_entropy_checkpoint(where, ctx.device)
    results = run_harness(
        ctx.model, args.tasks, args.include_path, args.limit,
        patcher_args=patcher_args, entropy_model=entropy_model, num_fewshot=args.num_fewshot,
        include_defaults=args.include_defaults, show_progress=ctx.progress and ctx.dp_rank == 0,
        batch_size=args.batch_size,
    )  # fmt: skip
    return _numeric_results(results)


def _register() -> None:
    register_task("harness", harness_eval_task, args_model=HarnessTaskArgs, in_loop=False)


_register()
