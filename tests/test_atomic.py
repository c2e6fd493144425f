"""raggym.atomic: a failed write leaves the old file or directory exactly as it was, and no temporaries."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest

from raggym.atomic import atomic_directory, atomic_write, atomic_write_json, atomic_write_text


def _names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_write_replaces_the_file_and_creates_parents(tmp_path):
    target = tmp_path / "a" / "b" / "out.txt"
    assert atomic_write_text(target, "first\n") == target
    atomic_write(target, lambda fh: fh.write("second\n"))
    assert target.read_text(encoding="utf-8") == "second\n"
    atomic_write(target, lambda fh: fh.write(b"\x00\xff"), mode="wb")
    assert target.read_bytes() == b"\x00\xff"
    assert _names(target.parent) == ["out.txt"]
    with pytest.raises(ValueError, match="mode"):
        atomic_write(target, lambda fh: None, mode="a")


@pytest.mark.parametrize("error", [RuntimeError("disk on fire"), KeyboardInterrupt()])
def test_error_mid_write_keeps_the_old_file_and_leaves_no_temp(tmp_path, error):
    target = tmp_path / "results.json"
    atomic_write_json(target, {"version": 1})

    def half_then_fail(fh):
        fh.write('{"version": 2, "rows": [')
        fh.flush()
        raise error

    with pytest.raises(type(error)):
        atomic_write(target, half_then_fail)
    assert json.loads(target.read_text(encoding="utf-8")) == {"version": 1}
    assert _names(tmp_path) == ["results.json"]


def test_process_killed_mid_write_keeps_the_old_file(tmp_path):
    target = tmp_path / "state.json"
    target.write_text('{"step": 1}', encoding="utf-8")
    child = textwrap.dedent(f"""
        import os
        from raggym.atomic import atomic_write

        def die(fh):
            fh.write('{{"step": 2, "half')
            fh.flush()
            os._exit(9)  # no exception handler, no cleanup: like SIGKILL or a power cut

        atomic_write({str(target)!r}, die)
    """)
    proc = subprocess.run([sys.executable, "-c", child], cwd=os.getcwd(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 9, proc.stderr
    assert json.loads(target.read_text(encoding="utf-8")) == {"step": 1}
    # The orphaned temporary is a hidden sibling, never the target's name or a visible file.
    assert [n for n in _names(tmp_path) if not n.startswith(".")] == ["state.json"]


def test_json_that_cannot_be_serialised_touches_nothing(tmp_path):
    target = tmp_path / "summary.json"
    with pytest.raises(TypeError):
        atomic_write_json(target, {"bad": object()})
    assert _names(tmp_path) == []
    atomic_write_json(target, {"path": tmp_path}, default=str, indent=None)
    assert target.read_text(encoding="utf-8") == json.dumps({"path": str(tmp_path)}) + "\n"


def test_new_files_are_world_readable_and_replaced_files_keep_their_mode(tmp_path):
    fresh = tmp_path / "fresh.txt"
    atomic_write_text(fresh, "x")
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o644
    private = tmp_path / "private.txt"
    private.write_text("secret")
    private.chmod(0o600)
    atomic_write_text(private, "new secret")
    assert stat.S_IMODE(private.stat().st_mode) == 0o600 and private.read_text() == "new secret"


def test_directory_appears_only_when_complete(tmp_path):
    final = tmp_path / "index"
    with atomic_directory(final) as tmp:
        assert tmp.parent == tmp_path and tmp.is_dir() and not final.exists()
        (tmp / "a.txt").write_text("1")
    assert _names(final) == ["a.txt"] and _names(tmp_path) == ["index"]
    assert stat.S_IMODE(final.stat().st_mode) == 0o755


def test_directory_replacement_is_all_or_nothing(tmp_path):
    final = tmp_path / "policy"
    with atomic_directory(final) as tmp:
        (tmp / "old.bin").write_text("old")
    with pytest.raises(RuntimeError, match="export failed"):
        with atomic_directory(final) as tmp:
            (tmp / "new.bin").write_text("half")
            raise RuntimeError("export failed")
    assert _names(final) == ["old.bin"] and _names(tmp_path) == ["policy"]
    with atomic_directory(final) as tmp:
        (tmp / "new.bin").write_text("new")
    assert _names(final) == ["new.bin"] and _names(tmp_path) == ["policy"]


def test_keep_existing_lets_the_first_complete_copy_win(tmp_path):
    final = tmp_path / "converted"
    with atomic_directory(final, keep_existing=True) as tmp:
        (tmp / "config.json").write_text("ours")
        final.mkdir()  # another process finishes first
        (final / "config.json").write_text("theirs")
    assert (final / "config.json").read_text() == "theirs" and _names(tmp_path) == ["converted"]
