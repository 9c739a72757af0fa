"""Device profile files: the simulated cluster's measured device, kept so that simulated
seconds do not depend on the load of the moment a run starts.

A profile is a small TOML file::

    [profile]
    format = 1
    model = "cnn"                 # model.name, or the factory's import path
    num_parameters = 421642       # P of the model it was measured on
    batch_size = 64               # the run's b (replica_ratios are measured at it)
    num_threads = 1               # torch threads of the measuring process
    torch = "2.13.0"
    machine = "host x86_64 Intel(R) ... 2 cores"
    memory_format = "channels_last"
    device = "cpu"                # or "cuda NVIDIA H200"
    precision = "fp32"
    compile = "off"
    model_kwargs = "{}"           # model.kwargs as sorted JSON
    measured_at = "2026-12-01T05:00:00"
    repeats = 3                   # the profile was measured this many times …
    spread = 0.04                 # … (max − min)/median of t(b) over them
    seconds_per_batch = 0.0009    # median over the repeats, seconds
    seconds_per_sample = 0.00048  # median over the repeats, seconds
    seconds_per_push = 0.0004     # parameter server's work per push, seconds (optional)
    seconds_per_iteration = 0.004 # synchronous learner's work per iteration beyond its
                                  # gradient, seconds (optional)
    replica_ratios = [1.0, 1.3]   # t(k)/t(1) at batch_size (optional)

Two uses (:func:`distsgd.runtime.factory.calibrated_config`):

* the **cache**: one file per (machine, model and P, batch size, threads, torch version,
  memory format, device, precision, compile, model kwargs)
  under :func:`cache_dir` (``$DISTSGD_PROFILE_CACHE``, else
  ``$XDG_CACHE_HOME/distsgd/profiles``, else ``~/.cache/distsgd/profiles``), written by the
  first run that calibrates and read by later ones; delete the file (or pass
  ``--recalibrate``) to measure again;
* a **named file** (``cluster.profile``, written by ``distsgd calibrate --out``): a device
  measured elsewhere, e.g. on the GPU node being planned for; it must be of the run's model
  (name and P), and is used whatever the machine, threads or torch version.

Optional fields a file may lack (written by an older distsgd): ``seconds_per_push`` and
``seconds_per_iteration`` read as None (not measured); a cached profile without them has
them measured and added when a run needs them, a named file without
``seconds_per_iteration`` charges none (0 s: the file's device was measured elsewhere).

Pure file handling: no torch computation here (the measurement is in
:mod:`distsgd.runtime.factory`).
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import platform
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from distsgd.config import ConfigError, ConfigWarning

__all__ = [
    "CACHE_ENV",
    "SPREAD_WARNING",
    "DeviceProfileFile",
    "ProfileKey",
    "ProfileSpreadWarning",
    "cache_dir",
    "cache_path",
    "check_cache_dir",
    "machine_id",
    "read_profile",
    "write_profile",
]

CACHE_ENV = "DISTSGD_PROFILE_CACHE"
FORMAT = 1
#: relative spread of the repeated measurement above which a run warns (the profile is
#: then as uncertain as the load of the machine was variable while it was measured)
SPREAD_WARNING = 0.25


class ProfileSpreadWarning(ConfigWarning):
    """The repeated measurements of a device profile disagree by more than
    :data:`SPREAD_WARNING` (printed as one line by the CLI)."""


def machine_id() -> str:
    """This machine, as a profile's key names it: host, architecture, CPU model, cores."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()} {platform.machine()} {cpu} {os.cpu_count()} cores"


@dataclass(frozen=True)
class ProfileKey:
    """What a cached profile was measured for; another value of any field measures again.

    Attributes:
        model: ``model.name`` or ``model.factory``.
        num_parameters: P of the model.
        batch_size: the run's b, samples.
        num_threads: torch threads of the process that measures.
        torch: ``torch.__version__``.
        machine: :func:`machine_id`.
        memory_format: the engine's resolved ``train.memory_format`` (``"contiguous"``
            or ``"channels_last"``; files without it were measured contiguous).
        device: ``"cpu"``, or ``"cuda <GPU name>"`` (files without it: the CPU).
        precision: ``train.precision`` (files without it: ``"fp32"``).
        compile: ``train.compile`` (files without it: ``"off"``).
        model_kwargs: ``model.kwargs`` as sorted JSON (files without it: unknown, so a
            cached one is measured again).
    """

    model: str
    num_parameters: int
    batch_size: int
    num_threads: int
    torch: str
    machine: str
    memory_format: str = "contiguous"
    device: str = "cpu"
    precision: str = "fp32"
    compile: str = "off"
    model_kwargs: str = ""

    def file_name(self) -> str:
        """``<model>-b<b>-t<threads>-<hash of all fields>.toml``."""
        digest = hashlib.sha256(repr(self).encode()).hexdigest()[:16]
        safe = "".join(c if c.isalnum() else "_" for c in self.model)[-40:]
        return f"{safe}-b{self.batch_size}-t{self.num_threads}-{digest}.toml"


@dataclass
class DeviceProfileFile:
    """A device profile as a file holds it (see the module docstring for the fields).

    ``seconds_per_push`` None: not measured; ``seconds_per_iteration`` None: not measured
    (seconds a synchronous learner works per iteration beyond its gradient, see
    :func:`distsgd.runtime.dist.calibrate_iteration`); ``replica_ratios`` empty: not
    measured.
    """

    key: ProfileKey
    seconds_per_batch: float
    seconds_per_sample: float
    repeats: int = 1
    spread: float = 0.0
    seconds_per_push: float | None = None
    replica_ratios: list[float] = field(default_factory=list)
    seconds_per_iteration: float | None = None
    measured_at: str = ""

    def seconds(self, batch_size: int) -> float:
        """Compute seconds of one minibatch of b = ``batch_size`` samples."""
        return self.seconds_per_batch + batch_size * self.seconds_per_sample


def cache_dir() -> Path:
    """Where cached profiles live: ``$DISTSGD_PROFILE_CACHE``, else
    ``$XDG_CACHE_HOME/distsgd/profiles``, else ``~/.cache/distsgd/profiles``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "distsgd" / "profiles"


def check_cache_dir() -> Path:
    """The cache directory, created if missing.

    Raises:
        ConfigError: it cannot be created or is not a writable directory (one line naming
            ``$DISTSGD_PROFILE_CACHE`` when that chose it).
    """
    path = cache_dir()
    where = (
        f"{CACHE_ENV} = {os.environ[CACHE_ENV]!r}"
        if os.environ.get(CACHE_ENV)
        else (f"the profile cache {str(path)!r}")
    )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"{where} is not allowed: cannot make it a directory ({type(e).__name__}); set "
            f"{CACHE_ENV} to a directory distsgd may write"
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{where} is not allowed: the directory is not writable; set {CACHE_ENV} to a "
            "directory distsgd may write"
        )
    return path


def cache_path(key: ProfileKey) -> Path:
    """The cache file of ``key`` (it may not exist)."""
    return cache_dir() / key.file_name()


def _toml_value(v: Any) -> str:
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def write_profile(path: Path, prof: DeviceProfileFile) -> None:
    """Write ``prof`` to ``path`` (parents created; written to a temporary file first and
    renamed, so a concurrent reader sees the old file or the new one).

    Raises:
        OSError: it cannot be written (the temporary file is removed).
    """
    values: dict[str, Any] = {
        "format": FORMAT,
        **asdict(prof.key),  # its fields in their order
        "measured_at": prof.measured_at,
        "repeats": prof.repeats,
        "spread": prof.spread,
        "seconds_per_batch": prof.seconds_per_batch,
        "seconds_per_sample": prof.seconds_per_sample,
    }
    if prof.seconds_per_push is not None:
        values["seconds_per_push"] = prof.seconds_per_push
    if prof.seconds_per_iteration is not None:
        values["seconds_per_iteration"] = prof.seconds_per_iteration
    if prof.replica_ratios:
        values["replica_ratios"] = [float(r) for r in prof.replica_ratios]
    text = "[profile]\n" + "".join(f"{n} = {_toml_value(v)}\n" for n, v in values.items())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no partial file behind
        raise


_REQUIRED = {
    "model": str,
    "num_parameters": int,
    "batch_size": int,
    "num_threads": int,
    "torch": str,
    "machine": str,
    "seconds_per_batch": float,
    "seconds_per_sample": float,
}


#: key fields that older files lack, and what such a file was measured with
_OPTIONAL_KEY_FIELDS = {"device": "cpu", "precision": "fp32", "compile": "off", "model_kwargs": ""}


def _refused(setting: str, path: Path, why: str) -> ConfigError:
    """The one-line refusal of the profile file ``path`` that ``setting`` named."""
    return ConfigError(f"{setting} = {str(path)!r} is not allowed: {why}")


def _field(setting: str, path: Path, raw: dict[str, Any], name: str, kind: type) -> Any:
    if name not in raw:
        raise _refused(
            setting,
            path,
            f"the profile has no {name!r} (write it with distsgd calibrate CONFIG --out FILE)",
        )
    v = raw[name]
    ok = isinstance(v, kind) and not isinstance(v, bool)
    if kind is float:
        ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
    if not ok:
        what = "number of seconds >= 0" if kind is float else kind.__name__
        raise _refused(setting, path, f"its {name} = {v!r} is not a {what}")
    return float(v) if kind is float else v


def read_profile(path: Path, setting: str = "cluster.profile") -> DeviceProfileFile:
    """Read a profile file.

    Args:
        path: the file.
        setting: the setting that named it, for the error message.

    Raises:
        ConfigError: the file is missing or unreadable, is not TOML, has no ``[profile]``
            table, or misses or has a bad required value (one line naming ``setting``).
    """
    refused = functools.partial(_refused, setting, path)
    try:
        raw = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise refused(f"cannot read it ({e.__class__.__name__})") from None
    except tomllib.TOMLDecodeError as e:
        raise refused(f"not TOML ({e})") from None
    table = raw.get("profile")
    if not isinstance(table, dict):
        raise refused(
            "it has no [profile] table (write it with distsgd calibrate CONFIG --out FILE)"
        )
    if table.get("format", FORMAT) != FORMAT:
        raise refused(
            f"its format = {table.get('format')!r} is not {FORMAT}, the format this distsgd "
            "reads (measure it again with distsgd calibrate CONFIG --out FILE)"
        )
    got = {n: _field(setting, path, table, n, kind) for n, kind in _REQUIRED.items()}
    spread = table.get("spread", 0.0)
    if not (
        isinstance(spread, int | float)
        and not isinstance(spread, bool)
        and math.isfinite(spread)
        and spread >= 0
    ):
        raise refused(f"its spread = {spread!r} is not a relative spread >= 0")
    spread = float(spread)
    repeats = table.get("repeats", 1)
    if not (isinstance(repeats, int) and not isinstance(repeats, bool) and repeats >= 1):
        raise refused(f"its repeats = {repeats!r} is not an integer >= 1")
    got["memory_format"] = table.get("memory_format", "contiguous")
    if got["memory_format"] not in ("contiguous", "channels_last"):
        raise refused(
            f"its memory_format = {got['memory_format']!r} is not 'contiguous' or 'channels_last'"
        )
    for name, default in _OPTIONAL_KEY_FIELDS.items():
        got[name] = table.get(name, default)
        if not isinstance(got[name], str):
            raise refused(f"its {name} = {got[name]!r} is not a string")
    key = ProfileKey(*(got[n] for n in ProfileKey.__dataclass_fields__))
    push = table.get("seconds_per_push")
    if push is not None:
        push = _field(setting, path, table, "seconds_per_push", float)
    per_iteration = table.get("seconds_per_iteration")
    if per_iteration is not None:
        per_iteration = _field(setting, path, table, "seconds_per_iteration", float)
    ratios = table.get("replica_ratios", [])
    if not isinstance(ratios, list) or any(
        not isinstance(r, int | float) or isinstance(r, bool) or not r > 0 for r in ratios
    ):
        raise refused(f"its replica_ratios = {ratios!r} is not a list of positive numbers")
    return DeviceProfileFile(
        key,
        got["seconds_per_batch"],
        got["seconds_per_sample"],
        repeats=repeats,
        spread=spread,
        seconds_per_push=push,
        replica_ratios=[float(r) for r in ratios],
        seconds_per_iteration=per_iteration,
        measured_at=str(table.get("measured_at", "")),
    )
