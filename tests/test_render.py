"""What the CLI prints for a person: strings from the wire made safe for a terminal."""

from __future__ import annotations

from loadmesh.daemon.render import printable, table


def test_controls_and_reordering_marks_are_escaped_everywhere_in_a_body() -> None:
    body = {"node\x1b": [{"model": "a\x1b[2Jb\x07", "n": 3}, "x\u202ey\u2066z\x9b\x7f"],
            "ok": "Llama-3.1 8B, é, 中文 — kept"}
    assert printable(body) == {
        "node\\x1b": [{"model": "a\\x1b[2Jb\\x07", "n": 3}, "x\\u202ey\\u2066z\\x9b\\x7f"],
        "ok": "Llama-3.1 8B, é, 中文 — kept"}


def test_a_value_cannot_forge_a_row_or_a_column() -> None:
    rows = [(printable("gpu-a\nFAKE  ok"), printable("x\ty"))]
    shown = table(("NODE", "STATE"), rows)
    assert shown.count("\n") == 1 and "\t" not in shown
    assert "gpu-a\\x0aFAKE  ok" in shown and "x\\x09y" in shown
