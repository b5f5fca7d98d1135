"""The demo's progress output: short whole lines in a log, an in-place bar on a terminal."""

import io

from zero_offload.demo import Progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_in_a_log_is_a_few_whole_lines():
    log = io.StringIO()
    p = Progress("OffloadOptimizer", 300, stream=log)
    for i in range(1, 301):
        p.update(i, f"loss {1 / i:.3f}")
    text = log.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 10 and lines[-1].startswith("OffloadOptimizer 300/300") and "ETA 0 s" in lines[-1]
    assert max(map(len, lines)) < 120


def test_progress_on_a_terminal_redraws_in_place():
    tty = _Tty()
    p = Progress("torch AdamW", 5, stream=tty)
    for i in range(1, 6):
        p.update(i, "loss 1.000")
    text = tty.getvalue()
    assert text.startswith("\r") and text.endswith("\n") and "5/5" in text
