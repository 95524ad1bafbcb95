"""Continue prompts with a checkpoint: a BLT, an H-Net (arch: hnet), a byte LM (arch: lm) or
an entropy model.

    python -m bytelatent.generate ckpt=DIR prompt="Hello" max_new_bytes=200 temperature=0
    python -m bytelatent.generate ckpt=DIR prompts_file=in.jsonl output=out.jsonl [use_cache=false]
    python -m bytelatent.generate ckpt=DIR mode=chat prompt="reverse abc"

``mode=chat`` (a fine-tuned checkpoint, docs/sft.md) wraps each prompt in the chat template the
run was trained with (its params.json's data.chat_template) as a user turn (a prompts file may
also hold ``messages`` lists, the conversation so far) and prints the assistant's answer, which
ends at the template's end-of-turn marker.

``ckpt`` is a DCP step folder, a consolidated folder or a released-layout folder. A prompts file
holds one JSON object per line with a ``prompt`` (or ``text``) string; the output file gets one
object per prompt: ``prompt``, ``continuation``, ``finish_reason``, ``n_bytes``. Other keys:
``entropy_ckpt`` (entropy model for entropy-patched BLTs only; defaults to the checkpoint's
``entropy_model_checkpoint_dir`` or a sibling ``entropy_model/``), ``patcher.*`` overrides,
``device``, ``progress`` (tqdm; default: only on a terminal), ``allow_arch_import`` (import the
module a ``"pkg.module:name"`` arch in params.json names; off: a checkpoint runs no code) and
every ``GenerationArgs`` field (``top_k``, ``top_p``, ``seed``, ``stop=[...]``, ``batch_size``,
``use_cache``).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field

from bytelatent.distributed.threads import set_tool_cpu_threads
from bytelatent.errors import ConfigError, DataError, UserError
from bytelatent.eval.generation.sampling import GenerationArgs


class GenerateArgs(GenerationArgs):
    """CLI arguments of ``python -m bytelatent.generate``."""

    model_config = ConfigDict(extra="forbid")

    ckpt: str = Field(
        ..., description="DCP step folder, consolidated folder or released-layout folder"
    )
    prompt: str | None = Field(None, description="one prompt (or prompts_file)")
    mode: Literal["complete", "chat"] = Field(
        "complete",
        description="complete: continue the prompt's bytes; chat: answer it as a user turn with "
        "the checkpoint's chat template (docs/sft.md)",
    )
    prompts_file: str | None = Field(
        None, description="JSONL, one object with a prompt (or text) string per line"
    )
    output: str | None = Field(
        None, description="JSONL of prompt, continuation, finish_reason, n_bytes; null: stdout"
    )
    entropy_ckpt: str | None = Field(
        None,
        description="entropy model for entropy patching; default: the checkpoint's "
        "entropy_model_checkpoint_dir or a sibling entropy_model/",
    )
    patcher: dict[str, Any] = Field(
        {}, description="patcher_args overrides over the checkpoint's, e.g. patcher.threshold=3"
    )
    device: str = Field("cpu", description="torch device, e.g. cpu, cuda, cuda:1")
    num_threads: int | None = Field(
        None,
        ge=1,
        description="CPU threads; null: $OMP_NUM_THREADS when set, else the cores less one "
        "(as the trainer chooses: a shared machine does not collapse)",
    )
    progress: bool | None = Field(
        None, description="tqdm bar over a prompts_file; null: only on a terminal"
    )
    allow_arch_import: bool = Field(
        False,
        description="import the module an arch 'pkg.module:name' in the checkpoint's params.json "
        "names (runs its code: only for a checkpoint you trust)",
    )

    def check_source(self) -> None:
        if (self.prompt is None) == (self.prompts_file is None):
            raise ConfigError("give exactly one of prompt=... or prompts_file=in.jsonl")

    def generation_args(self) -> GenerationArgs:
        return GenerationArgs(**{k: getattr(self, k) for k in GenerationArgs.model_fields})


def _conversation(messages: Any, where: str) -> list:
    """The turns of a `messages` list (the conversation so far, ending with a user turn)."""
    from bytelatent.data.chat import BadConversation, conversation_of

    try:  # the answer to come is not there yet: check the shape with a placeholder answer
        turns = conversation_of({"messages": [*messages, {"role": "assistant", "content": "-"}]})
    except BadConversation as exc:
        raise DataError(f"{where}: {exc}") from None
    return turns[:-1]


def read_prompts(path: str, chat: bool = False) -> list:
    if not Path(path).exists():
        raise DataError(f"{path}: prompts file does not exist")
    prompts = []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}:{number}: invalid UTF-8 at byte {exc.start}") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{number}: invalid JSON ({exc.msg})") from None
            text = row.get("prompt", row.get("text")) if isinstance(row, dict) else row
            if chat and isinstance(row, dict) and "messages" in row:
                prompts.append(_conversation(row["messages"], f"{path}:{number}"))
                continue
            if not isinstance(text, str):
                raise DataError(f"{path}:{number}: expected an object with a 'prompt' string")
            prompts.append(text)
    return prompts


def check_utf8(text: str, what: str) -> None:
    """DataError unless `text` is valid Unicode text: bytes that are not UTF-8 on the command
    line arrive as lone surrogates (Python's surrogateescape), as do JSON `\\ud800` escapes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        # surrogateescape maps an undecodable byte b to U+DC00 + b
        bad = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise DataError(
            f"{what} is not valid UTF-8 ({bad} at character {exc.start}); pass UTF-8 text"
        ) from None


def _progress(total: int, wanted: bool | None):
    if wanted is None:
        wanted = sys.stderr.isatty()
    if not wanted:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="prompt", file=sys.stderr)


def run(args: GenerateArgs) -> int:
    from bytelatent.eval.generation import load_generator

    args.check_source()
    chat = args.mode == "chat"
    prompts = [args.prompt] if args.prompt is not None else read_prompts(args.prompts_file, chat)
    if not prompts:
        raise DataError(f"{args.prompts_file}: no prompts")
    for index, prompt in enumerate(prompts):  # before the (slow) checkpoint load
        if prompt == "":
            raise DataError(f"prompt {index} is empty; give at least one byte")
        for text in [prompt] if isinstance(prompt, str) else [c for _, c in prompt]:
            check_utf8(text, f"prompt {index}")
    if chat:  # before the (slow) checkpoint load
        check_chat_checkpoint(args.ckpt)
    set_tool_cpu_threads(args.device.split(":")[0], args.num_threads)
    generator = load_generator(
        args.ckpt, args.device, args.entropy_ckpt, args.patcher or None,
        allow_arch_import=args.allow_arch_import,
    )  # fmt: skip
    if chat:
        return run_chat(args, prompts, generator)
    generator.encode(prompts)  # every prompt checked before any generation starts
    gen_args = args.generation_args()
    bar = _progress(len(prompts), args.progress if args.prompts_file else False)
    out = open(args.output, "w", encoding="utf-8") if args.output else None
    speed = GenerationSpeed()
    try:
        for first in range(0, len(prompts), gen_args.batch_size):
            batch = prompts[first : first + gen_args.batch_size]
            with speed.measure(generator) as results:
                results += generator.generate(batch, gen_args)
            for prompt, result in zip(batch, results):
                record = {
                    "prompt": prompt,
                    "continuation": result.text,
                    "finish_reason": result.finish_reason,
                    "n_bytes": len(result.data),
                }
                if out is not None:
                    out.write(json.dumps(record, ensure_ascii=False) + "\n")
                else:  # UTF-8 whatever the terminal's locale; invalid bytes already replaced
                    sys.stdout.buffer.write(result.text.encode("utf-8") + b"\n")
                    sys.stdout.flush()
            if bar is not None:
                bar.update(len(batch))
    finally:
        if out is not None:
            out.close()
        if bar is not None:
            bar.close()
    print(speed.line(torch_threads()), file=sys.stderr, flush=True)
    return 0


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


class GenerationSpeed:
    """Bytes generated over the seconds spent generating them (loading and prompts' encoding
    excluded), and the speculative acceptance over every batch, for the closing line."""

    def __init__(self):
        self.n_bytes = 0
        self.seconds = 0.0
        self.drafted = 0
        self.accepted = 0
        self.speculative = False

    @contextlib.contextmanager
    def measure(self, generator):
        results: list = []
        start = time.perf_counter()
        yield results
        self.seconds += time.perf_counter() - start
        self.n_bytes += sum(len(r.data) for r in results)
        stats = getattr(generator, "speculative_stats", None)
        if stats is not None:  # reset by every `generate` call: added up here
            self.speculative = True
            self.drafted += stats.drafted
            self.accepted += stats.accepted

    def line(self, threads: int) -> str:
        rate = self.n_bytes / self.seconds if self.seconds > 0 else float("nan")
        line = (
            f"generated {self.n_bytes} bytes in {self.seconds:.2f} s: {rate:.1f} bytes/s "
            f"({threads} thread{'s' if threads != 1 else ''})"
        )
        if self.speculative:
            accepted = self.accepted / self.drafted if self.drafted else float("nan")
            line += f"; speculative acceptance {accepted:.1%} ({self.accepted}/{self.drafted} drafted bytes)"
        return line


def check_chat_checkpoint(ckpt: str) -> None:
    """mode=chat needs a checkpoint fine-tuned with this code's chat template."""
    from bytelatent.checkpoint.pretrained import read_params
    from bytelatent.eval.chat import chat_template_of, check_template

    check_template(chat_template_of(read_params(ckpt.rstrip("/"))), ckpt)


def run_chat(args: GenerateArgs, prompts: list, generator: Any) -> int:
    """mode=chat: each prompt (a user turn, or the turns so far) answered with the template."""
    from bytelatent.eval.chat import generate_answers

    conversations = [[("user", p)] if isinstance(p, str) else p for p in prompts]
    answers = generate_answers(generator, conversations, args.generation_args())
    out = open(args.output, "w", encoding="utf-8") if args.output else None
    try:
        for turns, answer in zip(conversations, answers):
            if out is None:
                sys.stdout.buffer.write(answer.text.encode("utf-8") + b"\n")
                continue
            record = {"messages": [{"role": r, "content": c} for r, c in turns],
                      "answer": answer.text, "followed_template": answer.closed,
                      "finish_reason": answer.finish_reason}  # fmt: skip
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    finally:
        if out is not None:
            out.close()
    return 0


USAGE = "usage: python -m bytelatent.generate ckpt=DIR prompt=TEXT [key=value ...]"


def main(argv: list[str] | None = None) -> int:
    from bytelatent.config import parse_args
    from bytelatent.config.help import entry_help

    argv = sys.argv[1:] if argv is None else argv
    # a prompt is text, not YAML: "def f(x):" must not become a mapping
    prompts = [a.removeprefix("prompt=") for a in argv if a.startswith("prompt=")]
    rest = [a for a in argv if not a.startswith("prompt=")]
    try:
        if (page := entry_help(argv, usage=USAGE, model=GenerateArgs, doc=__doc__)) is not None:
            print(page, end="")
            return 0
        if len(prompts) > 1:
            raise DataError("give prompt=... once (use prompts_file=in.jsonl for several)")
        args = parse_args(GenerateArgs, rest)
        if prompts:
            args = GenerateArgs.model_validate({**args.model_dump(), "prompt": prompts[0]})
        return run(args)
    except UserError as exc:
        print(exc.one_line(), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
