"""Patcher: reference conformance (cases.pt), the §3.7 worked examples, and every mode's rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from torch import nn

from bytelatent.data.patch_rules import lengths_from_starts, split_long_patches
from bytelatent.data.patcher import Patcher, PatcherArgs
from bytelatent.errors import ConfigError, DataError
from tests.paths import CONFORMANCE, require_conformance

CASES_PATH = CONFORMANCE / "cases.pt"
DAENERYS = "Daenerys Targaryen is in Game of Thrones, a fantasy epic by George R.R. Martin."


def blt_tokens(text: str) -> list[int]:
    return [1] + [b + 4 for b in text.encode("utf-8")] + [2]


def patch_list(args: PatcherArgs, tokens: list[int], **kwargs) -> list[int]:
    lengths, _ = Patcher(args).patch(torch.tensor([tokens]), **kwargs)
    return lengths[0].tolist()


def load_cases() -> list[dict]:
    require_conformance("cases.pt")
    return torch.load(CASES_PATH, weights_only=True)


# ---------------------------------------------------------------- conformance (cases.pt)


CASE_CONFIGS = {
    "patcher_entropy": ({"patching_mode": "entropy"}, 1.0, False),
    "patcher_entropy_include_next": ({"patching_mode": "entropy"}, 1.0, True),
    "patcher_monotonicity_quarter_threshold": (
        {"patching_mode": "entropy", "monotonicity": True},
        0.25,
        False,
    ),
    "patcher_space": ({"patching_mode": "space"}, None, False),
    "patcher_static4": ({"patching_mode": "static", "patch_size": 4}, None, False),
}


@pytest.mark.parametrize("key", sorted(CASE_CONFIGS))
def test_reference_patcher_outputs(key: str) -> None:
    cases = load_cases()
    fields, threshold_scale, include_next = CASE_CONFIGS[key]
    for index, case in enumerate(cases):
        tokens = torch.tensor([case["input_ids"]])
        entropies = torch.tensor([case["entropies"]])
        args = PatcherArgs(**fields)
        if threshold_scale is not None:
            args = args.model_copy(update={"threshold": case["threshold"] * threshold_scale})
        lengths, scores = Patcher(args).patch(
            tokens, include_next_token=include_next, entropies=entropies
        )
        assert lengths.dtype == torch.long
        assert lengths[0].tolist() == case[key], f"case {index}"
        assert int(lengths.sum()) == tokens.shape[1] + include_next
        if fields["patching_mode"] == "entropy":
            assert torch.equal(scores, entropies)


def test_threshold_argument_overrides_args() -> None:
    case = load_cases()[0]
    tokens, entropies = (
        torch.tensor([case["input_ids"]]),
        torch.tensor([case["entropies"]]),
    )
    patcher = Patcher(PatcherArgs(threshold=100.0))
    assert patcher.patch(tokens, entropies=entropies)[0].shape[1] == 2  # BOS + the rest
    lengths, _ = patcher.patch(tokens, entropies=entropies, threshold=case["threshold"])
    assert lengths[0].tolist() == case["patcher_entropy"]


def test_conformance_cases_batched_and_padded() -> None:
    """All cases as one right-padded batch: each row patches as it does alone (no bleed)."""
    cases = load_cases()
    width = max(len(case["input_ids"]) for case in cases)
    tokens = torch.full((len(cases), width), 4 + ord("x"))
    entropies = torch.zeros((len(cases), width))
    for row, case in enumerate(cases):
        tokens[row, : len(case["input_ids"])] = torch.tensor(case["input_ids"])
        entropies[row, : len(case["entropies"])] = torch.tensor(case["entropies"])
    threshold = cases[0]["threshold"]
    lengths, _ = Patcher(PatcherArgs(threshold=threshold)).patch(tokens, entropies=entropies)
    for row, case in enumerate(cases):
        n = len(case["input_ids"])
        expected = case["patcher_entropy"][:-1] + [case["patcher_entropy"][-1] + width - n]
        got = [x for x in lengths[row].tolist() if x]
        assert got == expected
        assert lengths[row].tolist()[len(got) :] == [0] * (lengths.shape[1] - len(got))


def test_conformance_realtime_entropy_model() -> None:
    """realtime_patching loads the conformance entropy model and reproduces the reference."""
    cases = load_cases()
    args = PatcherArgs(
        realtime_patching=True,
        entropy_model_checkpoint_dir=str(CONFORMANCE / "entropy_model"),
        patching_device="cpu",
        threshold=cases[0]["threshold"],
        patching_batch_size=2,
    )
    patcher = Patcher(args)
    for case in cases:
        lengths, scores = patcher.patch(torch.tensor([case["input_ids"]]))
        assert torch.allclose(scores[0], torch.tensor(case["entropies"]), atol=1e-4)
        assert lengths[0].tolist() == case["patcher_entropy"]


def test_reference_patcher_args_from_released_params() -> None:
    """The patcher_args section of a reference params.json validates as is."""
    import json

    params_path = CONFORMANCE / "blt" / "params.json"
    require_conformance("blt/params.json")
    section = json.loads(params_path.read_text())["data"]["patcher_args"]
    args = PatcherArgs.model_validate(section)
    assert args.patching_mode.value == "entropy"
    assert args.patching_device == "cuda" and args.threshold == section["threshold"]


# ---------------------------------------------------------------- §3.7 worked examples


def test_daenerys_space_example() -> None:
    tokens = blt_tokens(DAENERYS)
    assert len(tokens) == 81
    expected = [1, 9, 10, 3, 3, 5, 3, 8, 3, 8, 5, 3, 7, 2, 2, 8, 1]
    assert patch_list(PatcherArgs(patching_mode="space"), tokens) == expected


def test_daenerys_static_example() -> None:
    tokens = blt_tokens(DAENERYS)
    args = PatcherArgs(patching_mode="static", patch_size=4)
    assert patch_list(args, tokens) == [4] * 20 + [1]
    assert patch_list(args, tokens, include_next_token=True) == [4] * 20 + [2]


# ---------------------------------------------------------------- rules of each mode


def test_entropy_global_threshold_rule() -> None:
    # H[t] > 1 starts a patch at t+1 (t >= 1); positions 0 and 1 always start
    entropies = torch.tensor([[9.0, 0.0, 2.0, 0.0, 0.0, 3.0, 0.0]])
    tokens = torch.full((1, 7), 100)
    patcher = Patcher(PatcherArgs(threshold=1.0))
    assert patcher.patch(tokens, entropies=entropies)[0].tolist() == [[1, 2, 3, 1]]
    # with the next token: H[6] does not exceed, so it joins the last patch
    got = patcher.patch(tokens, include_next_token=True, entropies=entropies)[0]
    assert got.tolist() == [[1, 2, 3, 2]]
    entropies[0, 6] = 5.0
    got = patcher.patch(tokens, include_next_token=True, entropies=entropies)[0]
    assert got.tolist() == [[1, 2, 3, 1, 1]]


def test_entropy_monotonicity_rule() -> None:
    # rise H[t] - H[t-1] > 0.5 starts at t+1; position 2 always starts in this mode
    entropies = torch.tensor([[0.0, 1.0, 1.2, 2.0, 2.1, 0.0, 0.7]])
    tokens = torch.full((1, 7), 100)
    patcher = Patcher(PatcherArgs(threshold=0.5, monotonicity=True))
    assert patcher.patch(tokens, entropies=entropies)[0].tolist() == [[1, 1, 2, 3]]


def test_entropy_threshold_add_rule() -> None:
    # start at t+1 iff H[t] - H[t-1] > 0.1 and H[t] > 1; position 2 always, position 3 never
    entropies = torch.tensor([[0.0, 0.0, 5.0, 0.5, 1.5, 1.55, 3.0, 2.0]])
    tokens = torch.full((1, 8), 100)
    patcher = Patcher(PatcherArgs(threshold=1.0, threshold_add=0.1))
    # starts: 0, 1, 2, (3 excluded), 5 (H4: rise 1.0, 1.5 > 1), 7 (H6: rise 1.45, 3 > 1)
    assert patcher.patch(tokens, entropies=entropies)[0].tolist() == [[1, 1, 3, 2, 1]]


def test_entropy_topk_rule_without_threshold() -> None:
    # N=12, patch_size=3 -> 12 // 3 - 2 = 2 extra starts after the two highest entropies
    entropies = torch.tensor([[0.0, 0.1, 0.2, 4.0, 0.1, 0.0, 0.2, 3.0, 0.1, 0.0, 0.0, 9.0]])
    tokens = torch.full((1, 12), 100)
    patcher = Patcher(PatcherArgs(threshold=None, patch_size=3))
    # H[11] would start position 12, outside the row: never picked without the next token
    assert patcher.patch(tokens, entropies=entropies)[0].tolist() == [[1, 3, 4, 4]]
    got = patcher.patch(tokens, include_next_token=True, entropies=entropies)[0]
    assert got.tolist() == [[1, 3, 8, 1]]  # H[11] and H[3] are the top two


def test_space_mode_rules() -> None:
    # runs count once, UTF-8 lead bytes count, continuation bytes do not, specials always count
    text = "ab, c\u00e9d"  # 'é' = C3 A9
    tokens = blt_tokens(text)
    got = patch_list(PatcherArgs(patching_mode="space"), tokens)
    # patches: BOS | "ab," | " c" C3 | A9 "d" EOS (a patch starts after ',' and after C3)
    assert got == [1, 3, 3, 3]
    got_next = patch_list(PatcherArgs(patching_mode="space"), tokens, include_next_token=True)
    assert got_next == [
        1,
        3,
        3,
        3,
        1,
    ]  # the EOS is special: the next token starts a patch


def test_bpe_mode() -> None:
    # 3 is the BPE delimiter; a patch starts after each one
    tokens = [1, 3, 104, 105, 3, 106, 107, 108, 3, 109, 3]
    args = PatcherArgs(patching_mode="bpe")
    assert patch_list(args, tokens) == [1, 1, 3, 4, 2]
    assert patch_list(args, tokens, include_next_token=True) == [1, 1, 3, 4, 2, 1]
    batch = torch.tensor([tokens, [1] + [104] * 10])
    lengths, scores = Patcher(args).patch(batch)
    assert scores is None
    assert lengths.tolist() == [[1, 1, 3, 4, 2], [1, 10, 0, 0, 0]]


def test_byte_mode() -> None:
    tokens = torch.tensor([[1, 5, 6, 7], [1, 8, 9, 2]])
    patcher = Patcher(PatcherArgs(patching_mode="byte"))
    assert patcher.patch(tokens)[0].tolist() == [[1] * 4] * 2
    assert patcher.patch(tokens, include_next_token=True)[0].tolist() == [[1] * 5] * 2


def reference_split(lengths: list[int], limit: int) -> list[int]:
    out = []
    for value in lengths:
        while value > limit:
            out.append(limit)
            value -= limit
        out.append(value)
    return out


def test_max_patch_length_splitting() -> None:
    tokens = blt_tokens(DAENERYS)
    args = PatcherArgs(patching_mode="space", max_patch_length=4)
    plain = patch_list(PatcherArgs(patching_mode="space"), tokens)
    got = patch_list(args, tokens)
    assert got == reference_split(plain, 4)
    assert max(got) == 4 and sum(got) == len(tokens)
    # rows of different lengths: zero padding stays at the end, widths are trimmed
    lengths = np.array([[1, 9, 2, 0, 0], [1, 1, 1, 1, 0], [3, 0, 0, 0, 0]])
    split = split_long_patches(lengths, 4)
    assert split.tolist() == [[1, 4, 4, 1, 2], [1, 1, 1, 1, 0], [3, 0, 0, 0, 0]]


def test_max_patch_length_with_entropy_mode() -> None:
    case = load_cases()[0]
    args = PatcherArgs(threshold=case["threshold"], max_patch_length=3)
    got = patch_list(args, case["input_ids"], entropies=torch.tensor([case["entropies"]]))
    assert got == reference_split(case["patcher_entropy"], 3)


def test_lengths_from_starts_pads_and_handles_empty() -> None:
    starts = np.array([[1, 1, 0, 1, 0], [1, 1, 0, 0, 0]], dtype=bool)
    assert lengths_from_starts(starts).tolist() == [[1, 2, 2], [1, 4, 0]]
    assert lengths_from_starts(np.zeros((2, 0), dtype=bool)).shape == (2, 0)


def test_short_rows() -> None:
    for mode in ("entropy", "space", "bpe", "byte"):
        patcher = Patcher(PatcherArgs(patching_mode=mode))
        one = torch.tensor([[1]])
        entropies = torch.zeros((1, 1)) if mode == "entropy" else None
        assert patcher.patch(one, entropies=entropies)[0].tolist() == [[1]]
        got = patcher.patch(one, include_next_token=True, entropies=entropies)[0]
        assert got.tolist() == [[1, 1]]


# ---------------------------------------------------------------- with an attached model


class CausalStandIn(nn.Module):
    """A tiny causal byte LM: logits at i depend on tokens i-2..i only."""

    def __init__(self, max_seqlen: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.max_seqlen = max_seqlen
        self.emb = nn.Embedding(260, 8)
        self.out = nn.Linear(24, 260)
        with torch.no_grad():
            self.out.weight.mul_(8.0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        shifted = [torch.nn.functional.pad(h, (0, 0, k, 0))[:, : h.shape[1]] for k in range(3)]
        return self.out(torch.cat(shifted, dim=-1)).float()


def test_batch_independence_with_model() -> None:
    torch.manual_seed(1)
    model = CausalStandIn(max_seqlen=16)
    rows = torch.randint(4, 260, (4, 37))
    rows[:, 0] = 1
    scores = Patcher(PatcherArgs(), entropy_model=model).patch(rows)[1]
    median = float(scores.median())  # a threshold that splits about half the positions
    patcher = Patcher(PatcherArgs(threshold=median, patching_batch_size=3), entropy_model=model)
    batch_lengths, batch_scores = patcher.patch(rows)
    for index in range(rows.shape[0]):
        alone, alone_scores = patcher.patch(rows[index : index + 1])
        assert torch.allclose(alone_scores[0], batch_scores[index], atol=1e-6)
        width = alone.shape[1]
        assert batch_lengths[index, :width].tolist() == alone[0].tolist()
        assert not batch_lengths[index, width:].any()
    assert batch_lengths.shape[1] > 10  # the threshold actually splits


class DelimiterAfterSpace(nn.Module):
    """Predicts the BPE delimiter (argmax 3) right after a space byte, else byte 'a'."""

    max_seqlen = 8

    def __init__(self) -> None:
        super().__init__()
        self.dummy = nn.Parameter(torch.zeros(()))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros((*tokens.shape, 260))
        logits[..., 4 + ord("a")] = 1.0
        logits[..., 3] = (tokens == 4 + ord(" ")).float() * 2.0
        return logits


def test_bpe_patcher_mode() -> None:
    tokens = blt_tokens("ab cd ef gh ijklmnopqrs")  # longer than the model's window of 8
    args = PatcherArgs(patching_mode="bpe_patcher")
    patcher = Patcher(args, entropy_model=DelimiterAfterSpace())
    got = patcher.patch(torch.tensor([tokens]))[0][0].tolist()
    assert got == [1, 3, 3, 3, 3, 12]  # a patch starts after each space
    with pytest.raises(ConfigError, match="bpe_patcher needs a model"):
        Patcher(args)


def test_log_time_records() -> None:
    patcher = Patcher(PatcherArgs(threshold=4.0, log_time=True), entropy_model=CausalStandIn())
    patcher.patch(torch.randint(4, 260, (2, 20)))
    assert patcher.log["tokens"] == 40 and patcher.log["calculate_entropies_seconds"] > 0


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"patching_mode": "static"}, "integer patch_size"),
        ({"patching_mode": "static", "patch_size": 0}, "integer patch_size"),
        ({"realtime_patching": True}, "entropy_model_checkpoint_dir"),
        ({"patching_mode": "space", "realtime_patching": True}, "only applies"),
        ({"monotonicity": True, "threshold_add": 0.1}, "set only one"),
        ({"max_patch_length": 0}, "max_patch_length"),
        ({"patching_batch_size": 0}, "patching_batch_size"),
        ({"patching_device": "gpu"}, "not a device"),
        ({"patching_device": "cpu", "device": "cuda"}, "disagree"),
        ({"patching_mode": "entropyy"}, "patching_mode"),
        ({"threshold_addd": 1.0}, "threshold_addd"),
    ],
)
def test_invalid_args(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        PatcherArgs(**fields)


def test_entropy_mode_without_entropies_or_model() -> None:
    with pytest.raises(ConfigError, match="without entropies"):
        Patcher(PatcherArgs()).patch(torch.tensor([[1, 5, 6]]))


def test_bad_shapes() -> None:
    patcher = Patcher(PatcherArgs())
    with pytest.raises(DataError, match="does not match"):
        patcher.patch(torch.tensor([[1, 5, 6]]), entropies=torch.zeros((1, 2)))
    with pytest.raises(DataError, match=r"\[batch, seq_len\]"):
        patcher.patch(torch.tensor([1, 5, 6]))


def test_patcher_constructor_matches_build() -> None:
    args = PatcherArgs(patching_mode="space")
    tokens = torch.tensor([blt_tokens("hello world")])
    assert torch.equal(Patcher(args).patch(tokens)[0], Patcher(args).patch(tokens)[0])
