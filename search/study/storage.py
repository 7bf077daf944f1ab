"""Where studies live: an Optuna storage from what the user typed after ``--storage``.

- nothing: ``results/studies.db`` (SQLite, embedded, zero set-up; every study in one file, which is what
  ``optuna-dashboard`` opens);
- a database URL (``sqlite:///f.db``, ``postgresql://user@host/db``, ``mysql+pymysql://…``): Optuna's RDB
  storage, which several workers on several hosts can share;
- a path ending in ``.db``/``.sqlite``/``.sqlite3``: that SQLite file;
- a path ending in ``.journal``/``.log``: an append-only journal file (Optuna's ``JournalStorage``), which
  suits network file systems where SQLite's locking does not.

Opening never creates a folder, and a command that only reads studies checks first that the file is there
(``check_existing_storage``), since SQLite and the journal create a missing file on opening it. Optuna and
SQLAlchemy are imported when a storage is opened, so that the command line starts without them.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

from servetune.errors import UserError
from servetune.paths import check_output_file

if TYPE_CHECKING:
    from optuna.storages import BaseStorage, RDBStorage

DEFAULT_STORAGE = "results/studies.db"
SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")
JOURNAL_SUFFIXES = (".journal", ".log")
# Seconds a worker waits for SQLite's write lock before giving up: other workers hold it only briefly.
SQLITE_LOCK_TIMEOUT_S = 60
IN_MEMORY_SQLITE = ("sqlite://", "sqlite:///:memory:")
SQLITE_URL_PREFIX = "sqlite:///"


def _flag(spec: Optional[str]) -> str:
    return f"--storage {spec}" if spec else f"the default storage {DEFAULT_STORAGE}"


def storage_file(spec: Optional[str]) -> Optional[Path]:
    """The file a storage lives in (a SQLite file, by path or ``sqlite:///`` URL, or a journal), or None for a
    database server or an in-memory SQLite database."""
    spec = spec or DEFAULT_STORAGE
    if "://" in spec:
        if spec in IN_MEMORY_SQLITE or not spec.startswith(SQLITE_URL_PREFIX):
            return None
        return Path(spec[len(SQLITE_URL_PREFIX):].partition("?")[0])
    return Path(spec) if Path(spec).suffix in SQLITE_SUFFIXES + JOURNAL_SUFFIXES else None


def check_existing_storage(spec: Optional[str]) -> None:
    """For commands that read studies: a UserError when the storage's file does not exist (opening it would
    create an empty one)."""
    path = storage_file(spec)
    if path is not None and not path.is_file():
        kind = "a folder" if path.is_dir() else "no such file"
        raise UserError(f"{_flag(spec)}: {kind}, expected a study storage (made by servetune tune)")


def check_writable_storage(spec: Optional[str]) -> None:
    """For commands that write studies: a UserError, before any work, when the storage's file cannot be
    created or written (a missing folder, a folder in its place, no permission)."""
    path = storage_file(spec)
    if path is not None:
        check_output_file(path, "--storage" if spec else "the default storage")


def open_storage(spec: Optional[str]) -> BaseStorage:
    spec = spec or DEFAULT_STORAGE
    if "://" in spec:
        return _rdb(spec)
    path = Path(spec)
    if path.suffix in SQLITE_SUFFIXES:
        return _rdb(f"{SQLITE_URL_PREFIX}{path}")
    if path.suffix in JOURNAL_SUFFIXES:
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        try:
            return JournalStorage(JournalFileBackend(str(path)))
        except OSError as error:
            raise UserError(f"--storage {spec}: cannot open the journal file ({error.strerror})") from None
    raise UserError(f"--storage {spec}: expected a database URL (sqlite:///f.db, postgresql://…), "
                    f"a SQLite file ({', '.join(SQLITE_SUFFIXES)}) or a journal file ({', '.join(JOURNAL_SUFFIXES)})")


def _rdb(url: str) -> RDBStorage:
    from optuna.storages import RDBStorage

    is_sqlite = url.startswith("sqlite")
    engine_kwargs = {"connect_args": {"timeout": SQLITE_LOCK_TIMEOUT_S}} if is_sqlite else {}
    try:
        storage = RDBStorage(url, engine_kwargs=engine_kwargs)
    except ImportError as error:
        raise UserError(f"--storage {url}: the database driver is not installed ({error}); for PostgreSQL: "
                        "pip install 'psycopg[binary]'") from None
    except Exception as error:   # SQLAlchemy's errors for a bad URL, an unreachable server, a refused login
        raise UserError(f"--storage {url}: cannot open the database ({str(error).splitlines()[0]})") from None
    if is_sqlite and url not in IN_MEMORY_SQLITE:
        _write_ahead_log(storage)
    return storage


def _write_ahead_log(storage: RDBStorage) -> None:
    """SQLite in write-ahead-log mode, synced at checkpoints rather than at every commit: a trial writes some
    forty attributes, each its own commit, and a synced commit costs ~20 ms here. A killed process loses
    nothing committed (the log is in the OS's hands); only a power cut could lose the last commits."""
    import sqlalchemy

    def on_connect(connection, _record) -> None:
        cursor = connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    sqlalchemy.event.listen(storage.engine, "connect", on_connect)
    storage.engine.dispose()   # connections made before the listener reopen with it


def study_names(storage: BaseStorage) -> list[str]:
    import optuna

    return [summary.study_name for summary in optuna.get_all_study_summaries(storage, include_best_trial=False)]
