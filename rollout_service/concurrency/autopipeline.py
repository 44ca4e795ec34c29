"""A Redis client for green workers that sends the commands of all its greenlets together.

A run worker drives hundreds of episodes in one process; each turn makes a couple of small
Redis calls (start and end of an LLM call) and each episode a dozen more. A round trip costs
the client far more CPU than a pipelined command (redis-py: connection pool, socket send, reply
parsing). This client queues every command a greenlet issues and one flusher greenlet sends
whatever has queued as one pipeline, so concurrent callers share round trips the way ioredis's auto-pipelining does.
Each caller still gets its own reply or exception, in order. Blocking commands go straight
through (they would hold every other caller's reply hostage). A plain pipeline joins the shared
round trip too (``SharedPipeline``); ``fire`` queues a script call whose reply nobody needs (the
end of an LLM call's accounting) without waiting for it, in order with the calls after it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

log = logging.getLogger(__name__)

BLOCKING_COMMANDS = frozenset(
    {
        "BLPOP",
        "BRPOP",
        "BRPOPLPUSH",
        "BLMOVE",
        "BLMPOP",
        "BZPOPMIN",
        "BZPOPMAX",
        "BZMPOP",
        "XREAD",
        "XREADGROUP",
        "WAIT",
        "WAITAOF",
        "SUBSCRIBE",
        "PSUBSCRIBE",
    }
)


class _Waiter:
    __slots__ = ("args", "options", "event", "reply", "error", "script")

    def __init__(
        self, args: tuple[Any, ...], options: dict[str, Any], event: Any, script: Script | None = None
    ) -> None:
        self.args, self.options, self.event, self.script = args, options, event, script
        self.reply: Any = None
        self.error: BaseException | None = None


class AutoPipelineRedis(redis.Redis):
    """``redis.Redis`` whose non-blocking commands ride shared pipelines (gevent only). While
    ``busy()`` says so (a run worker running many episodes sets it), a round trip waits ``linger_s``
    after the first command queued for it, gathering the commands other greenlets issue meanwhile:
    each round trip costs Redis a wake-up, a read and a write whatever it carries, and a process
    with little to gather would only wait."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.linger_s = 0.0
        self.busy: Callable[[], bool] = lambda: False
        self._queued: list[_Waiter] = []
        self._flushing = False
        self._loaded: set[str] = set()  # shas of the scripts this client loaded ahead of their calls

    def execute_command(self, *args: Any, **options: Any) -> Any:
        if str(args[0]).upper() in BLOCKING_COMMANDS:
            return super().execute_command(*args, **options)
        (reply,) = self.run_together([(args, options)])
        if isinstance(reply, Exception):
            raise reply
        return reply

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> redis.client.Pipeline:
        """A transaction is its own round trip; a plain pipeline's commands join the shared one."""
        if transaction:
            return super().pipeline(transaction, shard_hint)
        return SharedPipeline(self)

    def run_together(
        self, commands: list[tuple[tuple[Any, ...], dict[str, Any]]], scripts: Sequence[Script] = (), wait: bool = True
    ) -> list[Any]:
        """Queue ``commands`` back to back (the same shared round trip carries them all, in order);
        their replies (exceptions in place), or nothing at once when not ``wait``."""
        script_of = {script.sha: script for script in scripts}
        waiters = [
            _Waiter(
                args, options, _new_event() if wait else None, script_of.get(args[1]) if args[0] == "EVALSHA" else None
            )
            for args, options in commands
        ]
        self._enqueue(waiters)
        if not wait:
            return []
        for waiter in waiters:
            waiter.event.wait()
        return [waiter.error if waiter.error is not None else waiter.reply for waiter in waiters]

    def submit(self, script: Script, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Callable[[], Any]:
        """Queue ``script`` with the next shared round trip and return at once; calling the result
        waits for its reply (raises its error)."""
        waiter = _script_waiter(script, keys, args, _new_event())
        self._enqueue([waiter])

        def reply() -> Any:
            waiter.event.wait()
            if waiter.error is not None:
                raise waiter.error
            return waiter.reply

        return reply

    def submit_commands(self, commands: Sequence[tuple[Any, ...]]) -> Callable[[], list[Any]]:
        """Queue plain ``commands`` back to back with the next shared round trip and return at once;
        calling the result waits for their replies (exceptions in place)."""
        event = _new_event()  # set once their round trip is back: they ride the same one
        waiters = [_Waiter(args, {}, event) for args in commands]
        self._enqueue(waiters)

        def replies() -> list[Any]:
            event.wait()
            return [waiter.error if waiter.error is not None else waiter.reply for waiter in waiters]

        return replies

    def fire(self, script: Script, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> None:
        """Queue ``script`` with the next shared round trip and return at once."""
        self._enqueue([_script_waiter(script, keys, args, None)])

    def _enqueue(self, waiters: list[_Waiter]) -> None:
        import gevent

        self._queued.extend(waiters)
        if not self._flushing:
            self._flushing = True
            gevent.spawn(self._flush)

    def _flush(self) -> None:
        import gevent

        try:
            if self.linger_s > 0 and self.busy():
                gevent.sleep(self.linger_s)
            while self._queued:
                batch, self._queued = self._queued, []
                try:
                    pipe = redis.client.Pipeline(self.connection_pool, self.response_callbacks, False, None)
                    loads: list[int] = []  # positions of the SCRIPT LOADs sent ahead of a script's first call
                    for waiter in batch:
                        if waiter.script is not None and waiter.script.sha not in self._loaded:
                            loads.append(len(pipe.command_stack))
                            pipe.execute_command("SCRIPT", "LOAD", waiter.script.script)
                            self._loaded.add(waiter.script.sha)
                        pipe.execute_command(*waiter.args, **waiter.options)
                    replies = pipe.execute(raise_on_error=False)
                    for position in reversed(loads):
                        del replies[position]
                except BaseException as exc:  # the round trip itself failed: every caller sees it
                    for waiter in batch:
                        waiter.error = exc
                else:
                    for waiter, reply in zip(batch, replies):
                        if isinstance(reply, NoScriptError) and waiter.script is not None:
                            reply = self._run_unknown_script(
                                waiter.script, waiter
                            )  # the server lost it (restart, flush)
                        if isinstance(reply, Exception):
                            waiter.error = reply
                        else:
                            waiter.reply = reply
                for waiter in batch:
                    if waiter.event is not None:
                        waiter.event.set()
                    elif waiter.error is not None:
                        log.warning("a fired Redis call failed: %s", waiter.args[:1], exc_info=waiter.error)
        finally:
            self._flushing = False

    def _run_unknown_script(self, script: Script, waiter: _Waiter) -> Any:
        """Load the script again and run it directly (in the flusher, which must not wait on itself)."""
        try:
            redis.Redis.execute_command(self, "SCRIPT", "LOAD", script.script)
            return redis.Redis.execute_command(self, *waiter.args, **waiter.options)
        except Exception as exc:
            return exc


def _script_waiter(script: Script, keys: Sequence[Any], args: Sequence[Any], event: Any) -> _Waiter:
    return _Waiter(("EVALSHA", script.sha, len(keys), *keys, *args), {}, event, script)


def _new_event() -> Any:
    from gevent.event import Event

    return Event()


def submit(
    client: redis.Redis, script: Script, keys: Sequence[Any] = (), args: Sequence[Any] = ()
) -> Callable[[], Any]:
    """Start ``script`` now and take its reply later where the client can (AutoPipelineRedis: it
    rides the next shared round trip); elsewhere it runs at once."""
    if isinstance(client, AutoPipelineRedis):
        return client.submit(script, keys, args)
    try:
        reply = script(keys=keys, args=args)
    except Exception as exc:
        error = exc  # ``exc`` itself is unbound once the except block ends

        def failed() -> Any:
            raise error

        return failed
    return lambda: reply


def submit_commands(client: redis.Redis, commands: Sequence[tuple[Any, ...]]) -> Callable[[], list[Any]]:
    """Send plain ``commands`` now and take their replies (exceptions in place) later where the
    client can (AutoPipelineRedis: they ride the next shared round trip); elsewhere in one pipeline at once."""
    if isinstance(client, AutoPipelineRedis):
        return client.submit_commands(commands)
    pipe = client.pipeline(transaction=False)
    for args in commands:
        pipe.execute_command(*args)
    try:
        replies = pipe.execute(raise_on_error=False)
    except Exception as exc:
        replies = [exc] * len(commands)
    return lambda: replies


def fire(client: redis.Redis, script: Script, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> None:
    """Run ``script`` without waiting for its reply where the client can (AutoPipelineRedis)."""
    if isinstance(client, AutoPipelineRedis):
        client.fire(script, keys, args)
    else:
        script(keys=keys, args=args)


class SharedPipeline(redis.client.Pipeline):
    """A non-transactional pipeline of an AutoPipelineRedis: ``execute`` hands its commands to the
    client's shared round trip instead of taking a connection of its own (scripts included: the
    flusher loads a script ahead of its first call, no SCRIPT EXISTS round trip)."""

    def __init__(self, client: AutoPipelineRedis) -> None:
        super().__init__(client.connection_pool, client.response_callbacks, False, None)
        self.owner = client

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        commands, scripts = list(self.command_stack), list(self.scripts)
        self.reset()
        if not commands:
            return []
        replies = self.owner.run_together(commands, scripts)
        if raise_on_error:
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
        return replies

    def fire(self) -> None:
        """Send the commands with the next shared round trip and return at once (failures are logged)."""
        commands, scripts = list(self.command_stack), list(self.scripts)
        self.reset()
        if commands:
            self.owner.run_together(commands, scripts, wait=False)


class ScriptLoadingRedis(redis.Redis):
    """``redis.Redis`` for processes that are not green (gateway threads, eval's prefork children):
    a pipeline loads each script once per client, where redis-py asks SCRIPT EXISTS in a round trip
    of its own on every execute of a pipeline that calls one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loaded_scripts: set[str] = set()

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> redis.client.Pipeline:
        return ScriptLoadingPipeline(self, transaction, shard_hint)


class ScriptLoadingPipeline(redis.client.Pipeline):
    def __init__(self, client: ScriptLoadingRedis, transaction: bool, shard_hint: Any) -> None:
        super().__init__(client.connection_pool, client.response_callbacks, transaction, shard_hint)
        self.owner = client

    def load_scripts(self) -> None:
        for script in self.scripts:
            if script.sha not in self.owner.loaded_scripts:
                self.immediate_execute_command("SCRIPT LOAD", script.script)
                self.owner.loaded_scripts.add(script.sha)

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        """As redis-py's, and a script the server forgot (restart, SCRIPT FLUSH) is loaded again and
        its call run on its own: that call did nothing, the others ran."""
        commands, scripts = list(self.command_stack), {script.sha: script for script in self.scripts}
        replies = super().execute(raise_on_error=False)
        for position, reply in enumerate(replies):
            args, options = commands[position] if position < len(commands) else ((), {})
            if isinstance(reply, NoScriptError) and args[:1] == ("EVALSHA",) and args[1] in scripts:
                self.owner.loaded_scripts.clear()
                try:
                    self.owner.execute_command("SCRIPT", "LOAD", scripts[args[1]].script)
                    replies[position] = self.owner.execute_command(*args, **options)
                except Exception as exc:
                    replies[position] = exc
        if raise_on_error:
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
        return replies
