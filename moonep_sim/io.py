"""Side-effect helpers at the edge: the one atomic writer every output goes through.

Guarantees of :func:`write_bytes_atomic` (and the helpers built on it):

* **Nothing half-written.** The content is serialised to bytes first, written to a temporary file
  in the destination's own folder, fsynced, then renamed onto the destination (``os.replace``: a
  reader sees the old file or the new one, never a mix), and the folder is fsynced.
* **Nothing left behind.** On an error the temporary file is removed. A writer killed outright
  (SIGKILL, power loss) cannot clean up; its temporary file is named
  ``.<dest name>.<pid>.<8 hex>.msim-tmp`` and the next write into that folder removes every such
  file whose process is gone.
* **Ordinary mode.** The file is created with mode ``0o666`` less the umask (as ``open`` would),
  never the ``0600`` of ``mkstemp``.
* **One-line refusals**, before anything is written (:func:`check_output_path`): a destination that
  is a directory or not a regular file, a missing or unwritable folder, or a destination that is one
  of the command's inputs (``trace import X -o X`` would destroy the source).

The output rule every command applies before any work (:func:`check_outputs`, called from the CLI
through ``moonep_sim.cli.common.output_rule``): every output file, and every file an output folder
will hold, is compared by device and inode (links followed, so a symlink or a hard link to an input
is caught) with every input of the command, and refused in one line naming both. A folder output
is assembled in a temporary sibling (:func:`staged_dir`) and moved into place only when complete,
so a failure (a full disk, a plot that cannot be drawn) leaves nothing.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import math
import os
import re
import secrets
import shutil
import stat
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from moonep_sim.errors import ConfigError

TEMP_SUFFIX = ".msim-tmp"
_TEMP_RE = re.compile(r"^\..+\.(?P<pid>\d+)\.[0-9a-f]{8}" + re.escape(TEMP_SUFFIX) + "$")

PathLike = str | os.PathLike


def file_kind(mode: int) -> str:
    """A word for what a path is (``stat.S_IFMT`` of ``mode``): used in refusals."""
    for test, word in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return word
    return "not a regular file"


def temp_name(dest: Path) -> Path:
    """The temporary path beside ``dest`` a write or a staged folder uses (our naming: see the module docstring)."""
    return dest.with_name(f".{dest.name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one that is not ours to signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def load_average() -> list[float] | None:
    """The machine's 1, 5 and 15 minute load averages, rounded to 0.01 (other jobs inflate measured
    times); None where the platform has none."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def clean_stale_temps(folder: PathLike) -> list[Path]:
    """Remove temporary files of our naming in ``folder`` whose writing process is gone; returns them.

    Only files matching ``.<name>.<pid>.<8 hex>.msim-tmp`` are touched, and only when ``pid`` is
    not a live process (a live writer's file, in this process or another, is left alone)."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for e in entries:
        m = _TEMP_RE.match(e.name)
        if not m or int(m["pid"]) == os.getpid() or pid_alive(int(m["pid"])):
            continue
        with contextlib.suppress(OSError):
            if e.is_file(follow_symlinks=False):
                os.unlink(e.path)
                removed.append(Path(e.path))
            elif e.is_dir(follow_symlinks=False):  # a staged output folder (staged_dir)
                shutil.rmtree(e.path)
                removed.append(Path(e.path))
    return removed


def check_input_file(path: PathLike, what: str = "input") -> Path:
    """Refuse (one line) an input that does not exist or is not a regular file -- before opening it,
    so a named pipe or a device never blocks the reader. Returns the path."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ConfigError(f"{what} ({p}) must be an existing file: no such file") from None
    except OSError as e:
        raise ConfigError(f"{what} ({p}) must be a readable file: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{what} ({p}) must be a regular file: it is {file_kind(st.st_mode)}")
    return p


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def check_output_path(dest: PathLike, what: str = "output", inputs: Iterable[PathLike | None] = ()) -> Path:
    """Refuse (:class:`ConfigError`, one line naming ``what`` and the path) an output path the atomic
    writer could not honour, before any work is done: a directory or a non-regular file (a pipe, a
    device), a folder that is missing, not a directory or not writable, or one of ``inputs``.
    Returns the path."""
    p = Path(dest)
    if str(dest) == "":
        raise ConfigError(f"{what} ('') must be a file path")
    try:
        st = p.stat()
    except (FileNotFoundError, NotADirectoryError):
        st = None
    except OSError as e:
        raise ConfigError(f"{what} ({p}) must be a writable file path: {e.strerror}") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{what} ({p}) must be a file path: it is {file_kind(st.st_mode)}")
    for src in inputs:
        if src is not None and str(src) != "" and Path(src).exists() and _same_file(p, Path(src)):
            raise ConfigError(f"{what} ({p}) must differ from the input ({src}): writing it would destroy the input")
    folder = p.parent
    try:
        fst = folder.stat()
    except FileNotFoundError:
        raise ConfigError(f"{what} ({p}) must be in an existing folder: {folder} does not exist") from None
    except OSError as e:
        raise ConfigError(f"{what} ({p}) must be in a readable folder: {folder}: {e.strerror}") from None
    if not stat.S_ISDIR(fst.st_mode):
        raise ConfigError(f"{what} ({p}) must be in a folder: {folder} is {file_kind(fst.st_mode)}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} ({p}) must be in a writable folder: {folder} is not writable")
    return p


def check_output_dir(path: PathLike, what: str = "--out") -> Path:
    """Refuse (one line) an output folder that exists as something else, or that could not be
    created (its nearest existing ancestor is not a writable directory). Creates nothing."""
    p = Path(path)
    if str(path) == "":
        raise ConfigError(f"{what} ('') must be a folder path")
    if p.exists():
        st = p.stat()
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{what} ({p}) must be a folder: it is {file_kind(st.st_mode)}")
        if not os.access(p, os.W_OK | os.X_OK):
            raise ConfigError(f"{what} ({p}) must be a writable folder: it is not writable")
        return p
    anc = p.absolute().parent
    while not anc.exists():
        anc = anc.parent
    if not anc.is_dir():
        raise ConfigError(f"{what} ({p}) must be a folder path: {anc} is {file_kind(anc.stat().st_mode)}")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} ({p}) must be creatable: {anc} is not writable")
    probe = temp_name(anc / p.name)
    try:  # the mode bits do not tell all (/proc, a read-only mount): try the folder the staging needs
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        raise ConfigError(f"{what} ({p}) must be creatable: {anc}: {e.strerror}") from None
    return p


def make_output_dir(path: PathLike, what: str = "--out") -> Path:
    """:func:`check_output_dir`, then create the folder (and missing parents); one line on failure."""
    p = check_output_dir(path, what)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{what} ({p}) must be creatable: {e.strerror}") from None
    return p


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_bytes_atomic(dest: PathLike, data: bytes | bytearray | memoryview, *, what: str = "output",
                       inputs: Iterable[PathLike | None] = ()) -> Path:
    """Write ``data`` to ``dest`` atomically (see the module docstring); returns ``dest``.

    Raises :class:`ConfigError` (one line) for a path :func:`check_output_path` refuses, or when
    the write itself fails (disk full, ...); nothing is left behind in either case."""
    p = check_output_path(dest, what, inputs)
    clean_stale_temps(p.parent)
    tmp = temp_name(p)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
        try:
            view = memoryview(data).cast("B")
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, p)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        reason = e.strerror or errno.errorcode.get(e.errno or 0, str(e))
        raise ConfigError(f"{what} ({p}) must be writable: {reason}") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(p.parent)
    return p


def write_text_atomic(dest: PathLike, text: str, *, what: str = "output",
                      inputs: Iterable[PathLike | None] = ()) -> Path:
    """:func:`write_bytes_atomic` of ``text`` encoded as UTF-8."""
    return write_bytes_atomic(dest, text.encode("utf-8"), what=what, inputs=inputs)


def to_jsonable(obj: Any, *, lenient: bool = False) -> Any:
    """numpy scalars/arrays -> Python values, recursively (dict keys become strings).

    lenient: also turn non-finite floats and objects JSON cannot hold into strings (reports that
    carry arbitrary simulator and replay records).
    """
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v, lenient=lenient) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v, lenient=lenient) for v in obj]
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        obj = obj.item()
    if not lenient:
        return obj
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


# ------------------------------------------------------------------------------------ the output rule
#: Entries of a folder given as an input that are compared with the outputs (a folder of traces).
MAX_FOLDER_INPUT_ENTRIES = 10000


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of what ``path`` names, links followed; None when it names nothing readable."""
    try:
        st = path.stat()
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def _input_identities(inputs: Mapping[str, PathLike | None]) -> dict[tuple[int, int], tuple[str, Path]]:
    """(device, inode) -> (flag, path) of every input that exists; a folder input stands for its files."""
    ids: dict[tuple[int, int], tuple[str, Path]] = {}
    for flag, value in inputs.items():
        if value is None or str(value) == "":
            continue
        p = Path(value)
        ident = _identity(p)
        if ident is None:
            continue
        ids.setdefault(ident, (flag, p))
        if p.is_dir():
            with contextlib.suppress(OSError):
                for i, e in enumerate(os.scandir(p)):
                    if i >= MAX_FOLDER_INPUT_ENTRIES:
                        break
                    sub = _identity(Path(e.path))
                    if sub is not None:
                        ids.setdefault(sub, (flag, Path(e.path)))
    return ids


def folder_files(folder: PathLike, names: Sequence[str]) -> list[Path]:
    """The files an output folder will hold that exist now: each plain name, and every entry that
    matches a glob pattern (``*.png``)."""
    d = Path(folder)
    out: list[Path] = []
    for name in names:
        if any(ch in name for ch in "*?["):
            with contextlib.suppress(OSError):
                out += [Path(e.path) for e in os.scandir(d) if fnmatch.fnmatch(e.name, name)]
        else:
            out.append(d / name)
    return out


def check_outputs(files: Mapping[str, PathLike | None], inputs: Mapping[str, PathLike | None],
                  folders: Mapping[str, tuple[PathLike | None, Sequence[str]]] | None = None) -> None:
    """The output rule, before any work: refuse (:class:`ConfigError`, one line naming both) an
    output that is, by device and inode through any link, one of the inputs, or another output.

    files: flag -> output file path (None: not given). inputs: flag -> input path (None, or a name
    that is not a path, such as a preset: ignored). folders: flag -> (output folder, the names it will
    hold: plain names or glob patterns). Each file is also checked as :func:`check_output_path`
    checks it, and each folder as :func:`check_output_dir`."""
    ins = _input_identities(inputs)
    seen: dict[tuple[int, int] | str, str] = {}

    def against(flag: str, shown: str, target: Path) -> None:
        ident = _identity(target)
        if ident is not None and ident in ins:
            iflag, ipath = ins[ident]
            raise ConfigError(f"{shown} must differ from the input {iflag} ({ipath}): writing it would destroy "
                              "the input")
        key: tuple[int, int] | str = ident if ident is not None else os.path.abspath(target)
        if key in seen and seen[key] != flag:
            raise ConfigError(f"{shown} must differ from {seen[key]}: two outputs would write one file")
        seen[key] = flag

    for flag, value in files.items():
        if value is None:
            continue
        p = check_output_path(value, flag)
        against(flag, f"{flag} ({p})", p)
    for flag, (value, names) in (folders or {}).items():
        if value is None:
            continue
        d = check_output_dir(value, flag)  # the folder may hold inputs: only the files written in it count
        for f in folder_files(d, names):
            against(flag, f"{flag} ({d}) would write {f.name}, which", f)


@contextlib.contextmanager
def staged_dir(dest: PathLike, what: str = "--out") -> Iterator[Path]:
    """Assemble an output folder in a temporary sibling and move it into place when complete.

    Yields the temporary folder (``.<name>.<pid>.<8 hex>.msim-tmp`` beside ``dest``: the next write
    there removes it if this process is killed). On success: when ``dest`` does not exist the folder
    is renamed onto it (one atomic step); when it exists, each file is renamed into it (each file
    whole; files of ``dest`` the command does not write are left alone). On any error the temporary
    folder is removed and ``dest`` is untouched (not even created)."""
    d = check_output_dir(dest, what)
    parent = d.absolute().parent
    anc = parent
    while not anc.exists():  # missing parents are created only once the folder is complete
        anc = anc.parent
    clean_stale_temps(anc)
    tmp = temp_name(anc / d.name)
    try:
        try:
            tmp.mkdir(mode=0o777)
        except OSError as e:
            raise ConfigError(f"{what} ({d}) must be creatable: {anc}: {e.strerror}") from None
        try:
            yield tmp
        except ConfigError as e:  # a write inside failed: name the file where the user will look for it
            raise ConfigError(str(e).replace(str(tmp), str(d))) from None
        try:
            if not d.exists():
                parent.mkdir(parents=True, exist_ok=True)
                os.rename(tmp, d)
            else:
                for e in os.scandir(tmp):
                    os.replace(e.path, d / e.name)
        except OSError as e:
            raise ConfigError(f"{what} ({d}) must be writable: {e.strerror}") from None
        _fsync_dir(d)
        _fsync_dir(parent)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)


# ------------------------------------------------------------------------ small config files, read defensively
MAX_CONFIG_BYTES = 16 << 20
"""A model file, a Hugging Face config.json or a topology file (real ones are a few KiB)."""

MAX_NESTING = 64
"""Brackets and braces open at once in a config file (real ones nest 3 or 4 deep)."""

_STRINGS_RE = re.compile(rb'"""(?:[^\\]|\\.)*?"""|' + rb"'''.*?'''|" + rb'"(?:[^"\\\n]|\\.)*"|' + rb"'[^'\n]*'|#[^\n]*",
                         re.S)


def nesting_depth(raw: bytes, comments: bool = False) -> int:
    """The deepest nesting of ``[``/``{`` in JSON or TOML text, strings left out (and ``#`` comments
    when ``comments``: TOML); computed without recursion, vectorised, so it can be checked *before*
    a recursive parser sees the text."""
    text = _STRINGS_RE.sub(b'""', raw) if comments else re.sub(rb'"(?:[^"\\]|\\.)*"', b'""', raw)
    a = np.frombuffer(text, np.uint8)
    if a.size == 0:
        return 0
    step = (np.isin(a, (0x5B, 0x7B)).astype(np.int64) - np.isin(a, (0x5D, 0x7D)).astype(np.int64))
    return int(np.cumsum(step).max(initial=0))


def read_config_bytes(path: PathLike, what: str, kind: str) -> bytes:
    """The bytes of a small config file (``kind``: ``JSON`` or ``TOML``), refused in one line naming
    ``what`` and the path when it is not a regular readable file (a pipe, a folder, a symlink loop:
    each called what it is), larger than :data:`MAX_CONFIG_BYTES`, or nested deeper than
    :data:`MAX_NESTING` (a recursive parser would fail with RecursionError)."""
    p = check_input_file(path, what)
    st = p.stat()
    if st.st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{what} ({p}) must be at most {MAX_CONFIG_BYTES} bytes: it holds {st.st_size}")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"{what} ({p}) must be a readable file: {e.strerror}") from None
    depth = nesting_depth(raw, comments=kind == "TOML")
    if depth > MAX_NESTING:
        raise ConfigError(f"{p}: expected {kind} nested at most {MAX_NESTING} deep, found {depth}")
    return raw


try:  # the one TOML reader of the package (read_toml, data_toml)
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, published as tomli
    import tomli as tomllib


def read_toml(path: PathLike, what: str) -> dict[str, Any]:
    """A TOML config file, parsed: refused in one line naming ``what`` and the path where
    :func:`read_config_bytes` refuses it, or where it is not UTF-8 or not valid TOML."""
    raw = read_config_bytes(path, what, "TOML")
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError) as e:
        raise ConfigError(f"{what} ({path}) must be valid TOML: {e}") from None


def data_toml(name: str) -> dict[str, Any]:
    """The TOML file ``name`` shipped in ``moonep_sim/data``, parsed (the package's own data: a
    parse error there is a packaging fault, not bad input)."""
    from importlib import resources

    return tomllib.loads(resources.files("moonep_sim.data").joinpath(name).read_text())


def _first_non_finite(obj: Any, path: str = "") -> str | None:
    if isinstance(obj, float) and not math.isfinite(obj):
        return f"{path or 'the value'} ({obj})"
    if isinstance(obj, dict):
        for k, v in obj.items():
            hit = _first_non_finite(v, f"{path}.{k}" if path else str(k))
            if hit:
                return hit
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            hit = _first_non_finite(v, f"{path}[{i}]")
            if hit:
                return hit
    return None


def dumps_strict(obj: Any, **kw: Any) -> str:
    """``json.dumps`` of :func:`to_jsonable` ``(obj)`` as strict JSON: a NaN or an infinity (which
    ``json`` would write as the bare words ``NaN``/``Infinity``, not JSON) is refused in one line
    naming where it is. Inputs that would produce one are refused where they are read; this is the
    last guard."""
    import json

    doc = to_jsonable(obj)
    try:
        return json.dumps(doc, allow_nan=False, **kw)
    except ValueError:
        raise ConfigError(f"JSON output must hold finite numbers: {_first_non_finite(doc)} is not "
                          "(an input value is infinite or not a number)") from None
