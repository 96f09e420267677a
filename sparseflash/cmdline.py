"""What every command of sparseflash shares: the error contract and argument helpers. A leaf
module (it imports nothing of the library but `_env`), so the modules that contribute commands
(`sparseflash.analysis`, `experiments.bench.cli`, `experiments.lra.cli`) import it without an
import loop through `sparseflash.cli`, which loads them.

Errors: a known failure of a command -- data missing or malformed, a bad option or config value
(the ValueError / TypeError our validation raises, naming the argument), a file or folder that
cannot be read or written -- ends it with one line on stderr, ``sparseflash: error: <what> (<what
to do>)``, and exit status 2 (`EXIT_USAGE`, as argparse's own errors); a Ctrl-C ends it with exit
status 130. Anything else is a bug and keeps its traceback. ``SPARSEFLASH_DEBUG=1`` re-raises every
error, traceback included. Every ``python -m sparseflash.experiments...`` entry point runs its
``main`` through `run_command` and parses with `ArgumentParser`; commands check their arguments
and output folders (`check_output_dir`, `check_output_file`) before any work starts; `CommandError`
carries a known failure with its own remedy.

Outputs: a folder a command owns (a training run, a sweep, benchmark results, generated data)
that already holds files is refused (`claim_output_dir`); so is a file a command writes by name
that is already there (`claim_output_file`, `claim_output_files`): the one line names it and
``--overwrite``, and every file is left as it was.
"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import sys
import tempfile
from pathlib import Path

from sparseflash import _env

__all__ = ["EXIT_USAGE", "EXIT_INTERRUPTED", "CommandError", "ArgumentParser", "positive_int", "non_negative_int",
           "check_output_dir", "check_output_file", "claim_output_dir", "claim_output_file", "claim_output_files",
           "read_json_object", "known_error", "run_command"]

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

class CommandError(Exception):
    """A known failure and what to do about it: printed as ``sparseflash: error: <what> (<todo>)``."""

    def __init__(self, what: str, todo: str):
        super().__init__(what)
        self.todo = todo


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors (a bad or missing argument) are the contract's one line and exit 2.
    Subparsers inherit the class."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"sparseflash: error: {message} (see {self.prog} --help)\n")


def _integer(text: str, low: int, expected: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return v


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (the error names what was expected, never this function)."""
    return _integer(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """argparse type: an int >= 0."""
    return _integer(text, 0, "a non-negative integer")


def check_output_dir(path, option: str = "--out") -> Path:
    """Fail now, before any work, unless ``path`` is (or can become) a folder this process can
    write: the missing folders are made, a probe file written and removed, and the folders this
    made removed again (commands that refuse an existing output folder still see none).
    Raises `CommandError` naming ``option``."""
    path = Path(path)
    made = []
    try:
        missing = [p for p in (path, *path.parents) if not p.exists()]
        for p in reversed(missing):
            p.mkdir()
            made.append(p)
        if not path.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(path))
        fd, probe = tempfile.mkstemp(dir=path, prefix=".sparseflash-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CommandError(f"{option} {path}: cannot write there ({e.strerror or e})",
                           f"choose a folder you can write for {option}") from None
    finally:
        for p in reversed(made):
            try:
                p.rmdir()
            except OSError:
                pass
    return path


def claim_output_dir(path, *, owned, option: str = "--out", overwrite: bool = False, resume: bool = False,
                     kind: str = "a run", resumable: bool = True) -> Path:
    """The rule for a folder a command writes its run or results into (after `check_output_dir`): a
    folder that already holds files is a user's data, so the command refuses it with a
    `CommandError` naming ``--resume`` (``resumable`` commands) and ``--overwrite`` and
    leaves every file as it was; ``resume`` accepts it as it is; ``overwrite`` starts it afresh by
    removing the entries the command writes (``owned``: names or glob patterns, matched in the
    folder itself) -- and refuses, removing nothing, when it holds anything else, which this
    command did not write and will not delete."""
    path = Path(path)
    entries = sorted(path.iterdir()) if path.is_dir() else []
    if not entries or resume:
        return path
    how = "pass --resume to continue it, --overwrite" if resumable else "pass --overwrite"
    if not overwrite:
        names = ", ".join(e.name for e in entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise CommandError(f"{option} {path} already holds {kind} ({names})",
                           f"{how} to start it afresh, or choose another folder for {option}")
    ours = {e for pattern in owned for e in path.glob(pattern)}
    foreign = [e.name for e in entries if e not in ours]
    if foreign:
        raise CommandError(f"--overwrite: {option} {path} holds files this command did not write "
                           f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); nothing was removed",
                           f"move them away, or choose another folder for {option}")
    for e in entries:
        if e.is_dir() and not e.is_symlink():
            shutil.rmtree(e)
        else:
            e.unlink()
    return path


def check_output_file(path, option: str = "--out") -> Path:
    """`check_output_dir` for the folder of an output file ``path``, which must not be a folder."""
    path = Path(path)
    if path.is_dir():
        raise CommandError(f"{option} {path} is a folder", f"give {option} a file name such as {path / 'out.png'}")
    check_output_dir(path.parent if str(path.parent) else Path("."), option)
    return path


def claim_output_files(folder, names, *, overwrite: bool = False, option: str = "--out") -> list[Path]:
    """The rule for the files a command writes by name into ``folder`` (after `check_output_dir`):
    one that is already there is a user's data (an earlier result, or another file of that name),
    so the command refuses with a `CommandError` naming it and ``--overwrite``, before any work, and
    leaves every file as it was; ``overwrite`` lets it replace those files, and only those. Other
    files in ``folder`` do not matter. Returns the paths."""
    folder = Path(folder)
    paths = [folder / name for name in names]
    there = [p.name for p in paths if p.exists() or p.is_symlink()]
    if there and not overwrite:
        shown = ", ".join(there[:3]) + (", ..." if len(there) > 3 else "")
        raise CommandError(f"{option} {folder} already holds {shown}, which this command would replace",
                           f"pass --overwrite to replace {'it' if len(there) == 1 else 'them'}, or choose another "
                           f"folder for {option}")
    return paths


def claim_output_file(path, *, overwrite: bool = False, option: str = "--out") -> Path:
    """`claim_output_files` for one output file (after `check_output_file`): a file already at
    ``path`` is refused without ``overwrite``."""
    path = Path(path)
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise CommandError(f"{option} {path} already exists",
                           f"pass --overwrite to replace it, or choose another file for {option}")
    return path


def read_json_object(path, remedy: str) -> dict | None:
    """The JSON object in file ``path`` (a run's summary, a command's saved results), None when
    there is no such file; a file that is not valid JSON, or holds no object, raises ValueError
    naming it, with ``remedy`` (what to do about it)."""
    import json

    path = Path(path)
    if not path.exists():
        return None
    try:
        obj = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); {remedy}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path} holds a JSON {type(obj).__name__}, not an object; {remedy}")
    return obj


def known_error(e: BaseException) -> tuple[str, str] | None:
    """``(what, what to do)`` for a failure the user can fix, or None for a bug (keep its traceback).

    The LRA data errors are matched by class name so that this module never imports the
    experiments (they may not be installed)."""
    names = {c.__name__ for c in type(e).__mro__}
    what = str(e) or type(e).__name__
    if isinstance(e, CommandError):
        return what, e.todo
    if "DatasetNotFoundError" in names:
        return what, "check --data, or make the data: sparseflash lra data --help"
    if "MalformedDataError" in names:
        return what, "regenerate or replace that file: sparseflash lra data --help"
    if isinstance(e, OSError):
        if e.filename is not None and e.strerror:
            what = f"{e.strerror}: {e.filename}" + (f" -> {e.filename2}" if e.filename2 else "")
        if isinstance(e, FileExistsError):
            return what, "choose another output folder, or pass the command's --overwrite / --resume if it has one"
        if isinstance(e, PermissionError):
            return what, "choose a folder you can read and write"
        if isinstance(e, (FileNotFoundError, NotADirectoryError, IsADirectoryError)):
            return what, "check the path"
        if e.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT):
            return what, "check that the disk is writable and has space"
        if e.errno is None:  # not the system's error: a file that is not what it should be (an unreadable PNG)
            return what, "check that file; regenerate or replace it"
        return what, "check the path and its disk"
    if isinstance(e, (ValueError, TypeError)):
        return what, "see the command's --help; SPARSEFLASH_DEBUG=1 shows the traceback"
    return None


def run_command(func, *args) -> int:
    """``func(*args)`` under the error contract: its int result (None: 0); a known failure is one
    line on stderr and `EXIT_USAGE`, Ctrl-C `EXIT_INTERRUPTED`, a bug keeps its traceback."""
    debug = _env.debug()
    try:
        return int(func(*args) or 0)
    except KeyboardInterrupt:
        if debug:
            raise
        print("sparseflash: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:
        known = None if debug else known_error(e)
        if known is None:
            raise
        print(f"sparseflash: error: {known[0]} ({known[1]})", file=sys.stderr)
        return EXIT_USAGE
