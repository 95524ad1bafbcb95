"""Self-speculative decoding for the BLT (Fast BLT, arXiv 2605.08044): the model drafts bytes
past patch boundaries with its local models alone, then checks them with one full step.

Each round, for every open row (``n`` tokens fed, its next byte ``x`` already chosen):

1. draft: ``x`` and up to ``k - 1`` drafted bytes are fed with ``step(close_patches=False)``:
   the local encoder and decoder run, but no patch start is decided and the global transformer
   does not run, so every drafted byte reads the last closed patch's state. Each step's logits
   ``q`` choose the next draft byte; where the real patcher would not close a patch, ``q`` is
   the model's own distribution (such drafts are kept, up to rounding);
2. verify: the row is truncated back to ``n`` tokens and ``extend``ed by ``x`` and the ``k``
   drafts through the real model (its patcher; the patches that close among them go to the
   global transformer in one call), which gives the true logits ``p`` at every drafted position;
3. accept: greedy keeps drafts while each equals the argmax of ``p``; sampling keeps draft ``d``
   with probability ``min(1, p(d) / q(d))`` and, at the first rejection, draws the next byte from
   ``norm(max(0, p - q))`` (speculative sampling: the output is distributed as the model's), or
   from ``p`` after the last draft when all are kept. The rejected tail is truncated away; the
   byte drawn last is the next round's ``x``.

``p`` and ``q`` are filtered alike (temperature, top-k, top-p) before they are compared, so the
output follows the same distribution as ``Generator.generate_tokens``; greedy output is the same
bytes. Stop strings, EOS, ``max_new_bytes`` and the context limit are applied byte by byte with
the generator's own ``_finish``, and drafts never run past what a row may still produce.

Drafts step all rows of a batch together, and verification checks all open rows together with
the engine's ``extend_rows`` (one encoder, one global and one decoder call for the batch), so a
round costs one global call for all rows, as a plain step does (an engine without
``extend_rows`` is checked one row at a time).

Host syncs per round of all open rows (tests/generation/test_device_syncs.py): one read per
draft step (the drafted bytes: ``sample_rows``, or the draft logits when sampling), one in
``extend_rows`` with entropy patching (the verified bytes' entropies) and one for the check (the
true logits' argmaxes, or the logits when sampling, of every row at once): ``d + 2`` with ``d``
draft steps (at most k). Drafts and feeds stay on the host; the engine copies them to the device.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from bytelatent.errors import ConfigError
from bytelatent.eval.generation.sampling import GenerationArgs, filter_logits, sample_rows


@dataclass
class SpeculativeStats:
    """Counts over the rows' rounds (one round: one draft and one verification of one row)."""

    rounds: int = 0
    drafted: int = 0  # draft bytes checked
    accepted: int = 0  # draft bytes kept
    global_steps: int = 0  # global transformer calls after the prompts' prefill
    new_bytes: int = 0  # bytes generated (all rows)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def global_steps_per_byte(self) -> float:
        return self.global_steps / self.new_bytes if self.new_bytes else float("nan")

    def as_dict(self) -> dict[str, float]:
        return {
            **asdict(self),
            "acceptance_rate": self.acceptance_rate,
            "global_steps_per_byte": self.global_steps_per_byte,
        }


def filtered_probs(logits: torch.Tensor, args: GenerationArgs) -> torch.Tensor:
    """The sampling distribution [V] (float32, host) of logits [V], as ``sample_next`` draws."""
    scaled = filter_logits(logits.float().cpu() / args.temperature, args.top_k, args.top_p)
    return torch.softmax(scaled, dim=-1)


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


class SpeculativeEngine:
    """Generation with self-speculative decoding of up to ``k`` draft bytes per round.

    ``stats`` (a ``SpeculativeStats``, or the one given) accumulates over the calls of
    ``generate_tokens``.
    """

    def __init__(  # generator: a generator.Generator (not imported: no import circle)
        self, generator: Any, k: int, stats: SpeculativeStats | None = None
    ) -> None:
        if k < 1:
            raise ConfigError(f"speculative_k={k}: draft at least 1 byte (0 turns drafting off)")
        if not generator.is_blt:
            raise ConfigError(
                f"speculative_k={k}: self-speculative decoding drafts past patch boundaries and "
                f"needs a patched architecture (BLT), not {type(generator.model).__name__}; "
                "set speculative_k=0"
            )
        self.generator = generator
        self.k = k
        self.stats = stats if stats is not None else SpeculativeStats()

    @torch.no_grad()
    def generate_tokens(
        self,
        rows: list[list[int]],
        args: GenerationArgs,
        generators: list[torch.Generator] | None = None,
    ) -> list:
        """Continue token rows (each starting with BOS) as one batch -> GenerationResults;
        ``generators`` (one per row) default to ``args.seed`` for every row, as plain generation."""
        gen = self.generator
        if generators is None:
            generators = [torch.Generator().manual_seed(args.seed) for _ in rows]
        engine = gen._engine(rows, args.model_copy(update={"use_cache": True}))
        new: list[list[int]] = [[] for _ in rows]
        reasons: list[str | None] = [None] * len(rows)
        stops = [s.encode("utf-8") for s in args.stop]
        logits = engine.start(rows)
        impl = engine.impl
        if not all(hasattr(impl, name) for name in ("truncate", "extend")):
            raise ConfigError(
                f"{type(impl).__name__} cannot roll back; speculative decoding needs its "
                "truncate and extend"
            )
        steps_before = impl.global_steps
        if args.max_new_bytes == 0:
            reasons = ["length"] * len(rows)
        else:  # each row's first byte from its prompt's logits, as plain generation
            for b, token in sample_rows(logits, args, generators, list(range(len(rows)))).items():
                reasons[b] = gen._finish(rows[b], new[b], token, args, stops)
        while any(r is None for r in reasons):
            open_rows = [b for b in range(len(rows)) if reasons[b] is None]
            budget = {b: self._budget(rows[b], new[b], args) for b in open_rows}
            drafts, q_logits = self._draft(impl, new, budget, args, generators)
            fed = {b: len(rows[b]) + len(new[b]) - 1 for b in open_rows}  # last byte: chosen
            for b in open_rows:
                impl.truncate(b, fed[b])
            # host tensors: the engine copies them to the device (pinned) and keeps its books
            feeds = [torch.tensor([new[b][-1]] + drafts[b]) for b in open_rows]
            if hasattr(impl, "extend_rows"):  # every row's check in one call (one global step)
                checked = dict(zip(open_rows, impl.extend_rows(open_rows, feeds)))
            else:
                checked = {b: impl.extend(b, feed) for b, feed in zip(open_rows, feeds)}
            p_host = self._read_checks([checked[b] for b in open_rows], args)
            for b, p_logits in zip(open_rows, p_host):
                kept, token = self._verify(p_logits, q_logits[b], drafts[b], args, generators[b])
                impl.truncate(b, fed[b] + 1 + kept)
                self.stats.rounds += 1
                self.stats.drafted += len(drafts[b])
                self.stats.accepted += kept
                for byte in drafts[b][:kept] + [token]:
                    reasons[b] = gen._finish(rows[b], new[b], byte, args, stops)
                    if reasons[b] is not None:
                        break
        self.stats.global_steps += impl.global_steps - steps_before
        self.stats.new_bytes += sum(len(n) for n in new)
        return [
            gen._result(engine, b, rows[b], new[b], reasons[b], stops) for b in range(len(rows))
        ]

    def _budget(self, row: list[int], new: list[int], args: GenerationArgs) -> int:
        """Draft bytes for an open row this round: at most k, and no more than it may still
        produce after the chosen byte and the one drawn at the end of the round (max_new_bytes,
        the model's context; the caches hold that much)."""
        left = args.max_new_bytes - len(new)
        room = self.generator.max_tokens - len(row) - len(new)
        return max(0, min(self.k, left - 1, room - 1))

    def _draft(
        self,
        impl,
        new: list[list[int]],
        budget: dict[int, int],
        args: GenerationArgs,
        generators: list[torch.Generator],
    ) -> tuple[dict[int, list[int]], dict[int, list[torch.Tensor]]]:
        """Each open row's draft bytes and the draft logits [V] they were chosen from, stepping
        all rows together without closing patches."""
        batch = len(new)
        drafts: dict[int, list[int]] = {b: [] for b in budget}
        q_logits: dict[int, list[torch.Tensor]] = {b: [] for b in budget}
        tokens = [new[b][-1] if b in budget else 0 for b in range(batch)]
        for i in range(max(budget.values(), default=0)):
            rows = [b for b in budget if budget[b] > i]
            active = [b in rows for b in range(batch)]
            logits = impl.step(tokens, active, close_patches=False)
            if args.temperature == 0.0:
                picks = sample_rows(logits, args, generators, rows)
            else:
                host = logits.float().cpu()
                picks = {}
                for b in rows:
                    q_logits[b].append(host[b])
                    picks[b] = _draw(filtered_probs(host[b], args), generators[b])
            for b in rows:
                drafts[b].append(picks[b])
                tokens[b] = picks[b]
        return drafts, q_logits

    @staticmethod
    def _read_checks(checked: list[torch.Tensor], args: GenerationArgs) -> list:
        """The true logits of every open row ([T_i, V] on the device) on the host, in one read:
        greedy needs their argmaxes only (lists of ints), sampling the float32 logits."""
        sizes = [logits.shape[0] for logits in checked]
        if args.temperature == 0.0:
            targets = torch.cat([torch.argmax(logits, dim=-1) for logits in checked]).tolist()
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            return [targets[s : s + n] for s, n in zip(starts, sizes)]
        return list(torch.cat(checked).float().cpu().split(sizes))

    def _verify(
        self,
        p_logits: torch.Tensor | list[int],
        q_logits: list[torch.Tensor],
        drafts: list[int],
        args: GenerationArgs,
        generator: torch.Generator,
    ) -> tuple[int, int]:
        """(draft bytes kept, the byte drawn after them) from the true logits p_logits
        [len(drafts) + 1, V] on the host (greedy: their argmaxes): row i is the distribution of
        draft i, the last one's successor."""
        if args.temperature == 0.0:
            targets = p_logits
            kept = 0
            while kept < len(drafts) and drafts[kept] == targets[kept]:
                kept += 1
            return kept, targets[kept]
        host = p_logits
        for i, (byte, q_row) in enumerate(zip(drafts, q_logits)):
            p, q = filtered_probs(host[i], args), filtered_probs(q_row, args)
            # keep with probability min(1, p/q): q[byte] > 0, the draft was drawn from q
            if float(torch.rand((), generator=generator)) * float(q[byte]) < float(p[byte]):
                continue
            residual = (p - q).clamp(min=0)
            if float(residual.sum()) <= 0.0:  # p == q up to rounding: p itself
                residual = p
            return i, _draw(residual / residual.sum(), generator)
        return len(drafts), _draw(filtered_probs(host[-1], args), generator)
