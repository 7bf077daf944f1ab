"""Where studies live: an Optuna storage from what the user typed after ``--storage``.

- nothing: ``results/studies.db`` (SQLite, embedded, zero set-up; every study in one file, which is what
  ``optuna-dashboard`` opens);
- a database URL (``sqlite:///f.db``, ``postgresql://user@host/db``, ``mysql+pymysql://…``): Optuna's RDB
  storage, which several workers on several hosts can share;
- a path ending in ``.db``/``.sqlite``/``.sqlite3``: that SQLite file;
- a path ending in ``.journal``/``.log``: an append-only journal file (Optuna's ``JournalStorage``), which
  suits network file systems where SQLite's locking does not.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import optuna
import sqlalchemy
from optuna.storages import BaseStorage, JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend

from servetune.errors import UserError

DEFAULT_STORAGE = "results/studies.db"
SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")
JOURNAL_SUFFIXES = (".journal", ".log")
# Seconds a worker waits for SQLite's write lock before giving up: other workers hold it only briefly.
SQLITE_LOCK_TIMEOUT_S = 60
IN_MEMORY_SQLITE = ("sqlite://", "sqlite:///:memory:")


def open_storage(spec: Optional[str]) -> BaseStorage:
    spec = spec or DEFAULT_STORAGE
    if "://" in spec:
        return _rdb(spec)
    path = Path(spec)
    if path.suffix in SQLITE_SUFFIXES:
        path.parent.mkdir(parents=True, exist_ok=True)
        return _rdb(f"sqlite:///{path}")
    if path.suffix in JOURNAL_SUFFIXES:
        path.parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(str(path)))
    raise UserError(f"--storage {spec}: expected a database URL (sqlite:///f.db, postgresql://…), "
                    f"a SQLite file ({', '.join(SQLITE_SUFFIXES)}) or a journal file ({', '.join(JOURNAL_SUFFIXES)})")


def _rdb(url: str) -> RDBStorage:
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
    def on_connect(connection, _record) -> None:
        cursor = connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    sqlalchemy.event.listen(storage.engine, "connect", on_connect)
    storage.engine.dispose()   # connections made before the listener reopen with it


def study_names(storage: BaseStorage) -> list[str]:
    return [summary.study_name for summary in optuna.get_all_study_summaries(storage, include_best_trial=False)]
