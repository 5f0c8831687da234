"""The environment's persistent response cache: SQLite, one table, safe across tasks and processes.

Keyed by sha256 of (model ref, served name, messages including the system message, sampling parameters);
`EnvironmentClient` uses it only at temperature 0. Reads and writes are single-row statements on a local
file (microseconds), so they run inline on the event loop under a thread lock; WAL mode and a busy timeout
let several processes share the file. Error replies are never cached (the client's rule).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class CachedResponse:
    text: str
    prompt_tokens: int
    completion_tokens: int


class ResponseCache:
    """A persistent key → response table in SQLite, safe for concurrent asyncio tasks and processes.

    Reads and writes are single-row statements on a local file (microseconds), so they run inline on the
    event loop under a thread lock; WAL mode and a busy timeout let several processes share the file.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        with self._lock:
            self._connection()

    def _connection(self) -> sqlite3.Connection:
        """The open connection (reopened after `close()`, so a closed client can be used again)."""
        if self._conn is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, timeout=30.0, check_same_thread=False, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute(
                "CREATE TABLE IF NOT EXISTS responses (key TEXT PRIMARY KEY, model TEXT NOT NULL,"
                " text TEXT NOT NULL, prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,"
                " created REAL NOT NULL)"
            )
            self._conn = conn
        return self._conn

    @staticmethod
    def key(model: str, messages: list[dict[str, str]], sampling: dict[str, Any]) -> str:
        payload = json.dumps({"model": model, "messages": messages, "sampling": sampling},
                             sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()

    def get(self, key: str) -> CachedResponse | None:
        with self._lock:
            row = self._connection().execute(
                "SELECT text, prompt_tokens, completion_tokens FROM responses WHERE key = ?", (key,)
            ).fetchone()
        return CachedResponse(*row) if row else None

    def put(self, key: str, model: str, response: CachedResponse) -> None:
        with self._lock:
            self._connection().execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)",
                (key, model, response.text, response.prompt_tokens, response.completion_tokens, time.time()),
            )

    def __len__(self) -> int:
        with self._lock:
            return int(self._connection().execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
