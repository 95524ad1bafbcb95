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
