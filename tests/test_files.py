"""The commands' output folder (kascade.files): checked, held by one run, removed after a refusal by the run that
made it, and never by a run that did not hold it."""

import contextlib

import pytest

from kascade import files


def test_a_run_refused_on_a_new_path_another_run_holds_leaves_that_runs_folder(tmp_path, monkeypatch):
    """Two runs start on the same new path at once: both see it missing (each 'made' it), one holds it, the other is
    refused. The refused run used to remove the holder's folder and lock (the race, made certain here by letting
    the holder in between the refused run's look at the path and its check)."""
    out = tmp_path / "new" / "out"
    holder = contextlib.ExitStack()
    check_out = files.check_out

    def holder_gets_in_first(path):
        monkeypatch.setattr(files, "check_out", check_out)
        holder.enter_context(files.output_folder(out, "kascade eval"))  # the other run: makes the folder, holds it
        return check_out(path)

    monkeypatch.setattr(files, "check_out", holder_gets_in_first)
    with holder:
        with pytest.raises(ValueError, match="is in use by kascade eval"):
            with files.output_folder(out, "kascade bench"):
                pytest.fail("two runs held one folder")
        assert (out / files.LOCK).is_file(), "the refused run removed the holder's folder"
        (out / "rows.jsonl").write_text("{}\n")  # the holder goes on writing
        with pytest.raises(ValueError, match="is in use"):  # and still holds it
            with files.hold(out, "kascade bench"):
                pass
    assert (out / "rows.jsonl").is_file()


def test_the_holder_that_fails_before_writing_removes_what_it_made(tmp_path):
    out = tmp_path / "a" / "b"
    with pytest.raises(RuntimeError, match="model did not load"):
        with files.output_folder(out, "kascade calibrate"):
            raise RuntimeError("model did not load")
    assert not (tmp_path / "a").exists()
    with pytest.raises(RuntimeError):
        with files.output_folder(out, "kascade calibrate") as held:
            (held / "plan.json").write_text("{}")
            raise RuntimeError("later")
    assert (out / "plan.json").is_file()  # written into: kept
