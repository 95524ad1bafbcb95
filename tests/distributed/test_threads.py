"""CPU thread defaults: a trainer leaves a core to its data worker; explicit settings win."""

from bytelatent.distributed import threads
from bytelatent.distributed.threads import trainer_cpu_threads


def test_trainer_share_of_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(threads, "available_cores", lambda: 8)
    assert trainer_cpu_threads(None, 1, 1) == 7  # one core for the async loader worker
    assert trainer_cpu_threads(None, 1, 0) == 8
    assert trainer_cpu_threads(None, 2, 1) == 3  # two ranks on this machine
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    assert trainer_cpu_threads(None, 2, 1) == 1  # never below one
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert trainer_cpu_threads(None, 4, 1) == 1  # 4 ranks over several machines, 1 here


def test_explicit_settings_win(monkeypatch):
    monkeypatch.setattr(threads, "available_cores", lambda: 8)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert trainer_cpu_threads(None, 1, 1) is None  # torch already follows OMP_NUM_THREADS
    assert trainer_cpu_threads(5, 1, 1) == 5  # num_threads beats everything


def test_generation_and_eval_threads_follow_the_trainers_rule(monkeypatch):
    import torch

    from bytelatent.distributed.threads import set_tool_cpu_threads, tool_cpu_threads
    from bytelatent.eval.__main__ import parse_standalone_args  # noqa: F401 - torch-free enough
    from bytelatent.generate import GenerateArgs

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    assert tool_cpu_threads(None) == 1  # a shared 2-core machine: one core left over
    monkeypatch.setattr(threads, "available_cores", lambda: 8)
    assert tool_cpu_threads(None) == 7 and tool_cpu_threads(3) == 3
    before = torch.get_num_threads()
    try:
        assert set_tool_cpu_threads("cuda", None) is None and torch.get_num_threads() == before
        assert set_tool_cpu_threads("cpu", 2) == 2 and torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert set_tool_cpu_threads("cpu", None) is None  # torch already follows it
    finally:
        torch.set_num_threads(before)
    assert GenerateArgs(ckpt="x", prompt="a", num_threads=2).num_threads == 2
