"""The episodes of one process, each an OpenEnv environment instance, and the conversion between
OpenEnv's objects and the rollout's (api.py).

An episode opens with `reset(seed=..., episode_id=...)` (and `row=`, the prompt row, where the
class's reset takes it), lists its tools with `ListToolsAction` (MCP tools, JSON Schema inputs;
each becomes a function in the OpenAI format the chat templates take), calls them with
`CallToolAction`, and closes with the model's last answer: its reward is the environment's
`score(answer)` where it has one, else the last reward an observation carried (0.0 if none).
An MCP environment's episode holds its MCP session open from open to close and steps through
`step_async` on the host's event loop, as OpenEnv's own server does (sessions.py).

A call the model got wrong (a tool the episode does not offer, arguments its schema refuses) is
answered here without reaching the environment; a tool that raises, or an environment whose
step raises, is an error observation. Used in worker processes (workers.py) and in-process
(local.py) alike.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib
import inspect
import json
import os
import queue
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from runtime.environments.sandbox import SandboxUnavailable
from runtime.environments.sessions import Loop, Session, awaitable

# A function name the chat templates and the OpenAI tool format take.
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# Shipped environments (recipes/names.py BUILTIN_ENVIRONMENTS): the class, and whether it is
# built with the recipe's sandbox limits.
BUILTINS = {
    "python": ("runtime.environments.python_env:PythonEnvironment", True),
    "tiny-tools": ("runtime.tasks.tiny_tools.environment:LookupEnvironment", False),
}


class EnvironmentProblem(Exception):
    """The recipe's environment cannot be hosted (not importable, not an Environment, tools the
    chat template cannot express); `str()` is one line."""


@dataclass(frozen=True)
class Spec:
    """What a host builds each episode's environment from: `module:Class` and its keyword
    arguments (picklable, sent to worker processes)."""

    target: str
    args: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_section(cls, env: Any) -> Spec:
        """From a recipe's `env` section (recipes/environment.py)."""
        args = dict(env.args)
        if env.builtin:
            target, sandboxed = BUILTINS[env.name.removeprefix("builtin:")]
            if sandboxed:
                args.setdefault("limits", env.sandbox.model_dump())
            return cls(target, args)
        return cls(env.name, args)


def load_class(target: str) -> type:
    module, _, name = target.partition(":")
    try:
        found = getattr(importlib.import_module(module), name)
    except Exception as e:  # the user's module may raise anything while it imports
        raise EnvironmentProblem(
            f"environment {target}: cannot import it: {type(e).__name__}: {e}"
        ) from None
    from openenv.core.env_server.interfaces import Environment

    if not (isinstance(found, type) and issubclass(found, Environment)):
        raise EnvironmentProblem(f"environment {target}: not an OpenEnv Environment subclass")
    return found


# Tools already checked (function_schema) and their argument validators (_refusal), by the
# tool's JSON: an environment lists the same tools for every episode, and checking a schema
# against JSON Schema's meta-schema costs milliseconds, more than a small episode's whole work.
_CHECKED: dict[str, dict[str, Any]] = {}
_VALIDATORS: dict[str, Any] = {}
_CACHED = 1024


def function_schema(tool: Any) -> dict[str, Any]:
    """An OpenEnv `Tool` as a function in the OpenAI tool format; EnvironmentProblem where the
    chat template could not express it."""
    name, schema = tool.name, tool.input_schema or {"type": "object", "properties": {}}
    key = json.dumps([name, tool.description, schema], sort_keys=True, default=str)
    checked = _CHECKED.get(key)
    if checked is None:
        checked = _function_schema(name, tool.description, schema)
        if len(_CHECKED) < _CACHED:
            _CHECKED[key] = checked
    return copy.deepcopy(checked)  # the caller's own


def _function_schema(name: Any, description: Any, schema: Any) -> dict[str, Any]:
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise EnvironmentProblem(
            f"tool {name!r}: a tool name is 1-64 letters, digits, '_' or '-' (what the chat "
            "templates' function calls take)"
        )
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise EnvironmentProblem(
            f"tool {name!r}: its input schema must be a JSON Schema object (type: object, "
            f"properties), got {json.dumps(schema, default=str)[:80]}"
        )
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        raise EnvironmentProblem(f"tool {name!r}: not a valid JSON Schema: {e.message}") from None
    return {
        "type": "function",
        "function": {"name": name, "description": description or "", "parameters": schema},
    }


def result_text(result: Any) -> str:
    """A tool's result as the text of the tool message: MCP content parts' text, else JSON."""
    if result is None:
        return ""
    if isinstance(result, str):
        return result
    content = getattr(result, "content", None)
    if isinstance(content, list):
        return "\n".join(str(getattr(part, "text", part)) for part in content)
    data = getattr(result, "data", result)
    try:
        return json.dumps(data, default=str)
    except (TypeError, ValueError):
        return str(data)


# OpenEnv's tool error kinds -> api.ERRORS
_ERROR_KINDS = {
    "tool_not_found": "unknown_tool",
    "invalid_args": "malformed",
    "timeout": "timeout",
    "execution_error": "raised",
}


@dataclass
class _Episode:
    env: Any
    tools: dict[str, dict[str, Any]]
    reward: float | None = None
    session: Session | None = None  # its MCP session, held open (sessions.py)


class Host:
    """The episodes of one process. Methods are blocking and thread-safe per episode (one call
    of an episode at a time, as a rollout makes them); results are plain dicts and lists, so
    that they cross a pipe."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.cls = load_class(spec.target)
        self.episodes: dict[str, _Episode] = {}
        # episodes of an environment with its own step_async step on this loop (sessions.py)
        self.awaitable = awaitable(self.cls)
        self.loop = Loop()
        params = inspect.signature(self.cls.reset).parameters.values()
        self._takes_row = any(
            p.name == "row" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params
        )

    def _build(self) -> Any:
        try:
            return self.cls(**self.spec.args)
        except (EnvironmentProblem, SandboxUnavailable):
            raise  # its own line says what to do
        except Exception as e:
            raise EnvironmentProblem(
                f"environment {self.spec.target}: building it with env.args "
                f"{json.dumps(self.spec.args, default=str)[:80]} raised "
                f"{type(e).__name__}: {e}".replace("\n", " ")
            ) from None

    def _act(self, env: Any, action: Any) -> Any:
        """`env`'s observation of `action`: through its own step_async on the loop (its MCP
        session open), else its step in this thread."""
        if self.awaitable:
            return self.loop.run(env.step_async(action))
        return env.step(action)

    def _session(self, env: Any) -> Session | None:
        return self.loop.run(Session.open(env)) if self.awaitable else None

    def tools_of(self, env: Any) -> list[dict[str, Any]]:
        from openenv.core.env_server.mcp_types import ListToolsAction

        obs = self._act(env, ListToolsAction())
        failed = (getattr(obs, "metadata", None) or {}).get("error")
        if failed:
            raise EnvironmentProblem(
                f"environment {self.spec.target}: listing its tools failed: {failed}"
            )
        return [function_schema(tool) for tool in getattr(obs, "tools", [])]

    def probe(self) -> list[dict[str, Any]]:
        """Build one environment and list its tools, to fail before any episode does."""
        env = self._build()
        try:
            return self.tools_of(env)  # step_async opens the session for this one call
        finally:
            _close(env)

    def open(self, episode: str, row: dict[str, Any], seed: int) -> dict[str, Any]:
        env = self._build()
        kwargs = {"row": row} if self._takes_row else {}
        obs = env.reset(seed=seed, episode_id=episode, **kwargs)
        session = None
        try:
            session = self._session(env)
            tools = self.tools_of(env)
        except BaseException:
            self._end(env, session)
            raise
        names = {t["function"]["name"]: t for t in tools}
        self.episodes[episode] = _Episode(env, names, session=session)
        messages = getattr(obs, "messages", None) or (obs.metadata or {}).get("messages") or []
        return {"tools": tools, "messages": list(messages)}

    def step(self, episode: str, name: str, arguments: Any) -> dict[str, Any]:
        """One tool call: {"text", "reward", "done", "error", "seconds"}."""
        ep = self.episodes[episode]
        refused = _refusal(ep.tools, name, arguments)
        if refused is not None:
            return {**refused, "seconds": 0.0}
        from openenv.core.env_server.mcp_types import CallToolAction

        start = time.monotonic()
        try:
            obs = self._act(ep.env, CallToolAction(tool_name=name, arguments=arguments))
        except Exception as e:
            return {
                "text": f"tool {name} raised {type(e).__name__}: {e}",
                "error": "raised",
                "seconds": time.monotonic() - start,
            }
        seconds = time.monotonic() - start
        if obs.reward is not None:
            ep.reward = float(obs.reward)
        out = {"reward": obs.reward, "done": bool(obs.done), "seconds": seconds}
        error = getattr(obs, "error", None)
        result = getattr(obs, "result", None)
        if error is not None:
            kind = _ERROR_KINDS.get(str(getattr(error.error_type, "value", "")), "raised")
            return {**out, "text": f"error: {error.message}", "error": kind}
        if getattr(result, "is_error", False):
            return {**out, "text": f"error: {result_text(result)}", "error": "raised"}
        return {**out, "text": result_text(result), "error": None}

    def close(self, episode: str, answer: str) -> float:
        ep = self.episodes.pop(episode)
        try:
            score = getattr(ep.env, "score", None)
            if callable(score):
                return float(score(answer))
            return ep.reward if ep.reward is not None else 0.0
        finally:
            self._end(ep.env, ep.session)

    def drop(self, episode: str) -> None:
        """Forget an episode without a reward (it ran past its time): its session is let go
        without waiting (a call of it may still hang)."""
        ep = self.episodes.pop(episode, None)
        if ep is not None:
            if ep.session is not None:
                self.loop.soon(ep.session.end_soon)
            _close(ep.env)

    def stop(self) -> None:
        """Drop every episode and end the loop (an in-process host's end)."""
        for episode in list(self.episodes):
            self.drop(episode)
        self.loop.stop()

    def _end(self, env: Any, session: Session | None) -> None:
        if session is not None:
            with contextlib.suppress(Exception):
                self.loop.run(session.close())
        _close(env)


def serve(conn: Connection, spec: Spec) -> None:
    """A worker process (workers.py): build the host, say whether it is ready, then answer
    requests. Both ways a message is a list: requests (req, op, args), answers (req, ok,
    value), as many as were waiting, so that many small episodes cost few pipe writes."""
    try:
        host = Host(spec)
        host.probe()
    except EnvironmentProblem as e:
        conn.send([(0, False, str(e))])
        return
    except BaseException as e:
        conn.send([(0, False, f"{type(e).__name__}: {e}".replace("\n", " "))])
        return
    # What the worker holds now (OpenEnv, the environment's module: about 200k objects) lives as
    # long as it does: frozen, the collector scans only what the episodes make, not all of it
    gc.freeze()
    conn.send([(0, True, "ready")])
    answers: queue.SimpleQueue = queue.SimpleQueue()
    threads = ThreadPoolExecutor(max_workers=64, thread_name_prefix="forgesky-env")

    def answer(req: int, op: str, args: tuple) -> None:
        try:
            answers.put((req, getattr(host, op)(*args), True))
        except Exception as e:
            answers.put((req, f"{type(e).__name__}: {e}", False))

    def send() -> None:
        while True:
            batch = [answers.get()]
            with contextlib.suppress(queue.Empty):
                while True:
                    batch.append(answers.get_nowait())
            try:
                conn.send([(req, ok, value) for req, value, ok in batch])
            except (OSError, ValueError):
                return  # the run is gone
            except Exception:  # an answer that cannot be pickled: the others still go
                for req, value, ok in batch:
                    try:
                        conn.send([(req, ok, value)])
                    except (OSError, ValueError):
                        return
                    except Exception as e:
                        conn.send([(req, False, f"the answer cannot be sent: {e}")])

    threading.Thread(target=send, daemon=True, name="forgesky-env-send").start()
    while True:
        try:
            batch = conn.recv()
        except (EOFError, OSError):
            break
        if any(op == "stop" for _, op, _ in batch):
            break
        for req, op, args in batch:
            threads.submit(answer, req, op, args)
    os._exit(0)  # threads of hung tools must not hold the process


def _refusal(tools: dict[str, dict[str, Any]], name: str, arguments: Any) -> dict | None:
    """The error observation for a call the episode cannot take, or None."""
    if name not in tools:
        offered = ", ".join(tools) or "none"
        return {
            "text": f"error: there is no tool {name!r}; the tools are: {offered}",
            "error": "unknown_tool",
        }
    if not isinstance(arguments, dict):
        return {"text": f"error: {name}'s arguments must be a JSON object", "error": "malformed"}
    schema = tools[name]["function"]["parameters"]
    problem = next(iter(_validator(schema).iter_errors(arguments)), None)
    if problem is not None:
        where = ".".join(str(p) for p in problem.absolute_path) or "arguments"
        return {"text": f"error: {name}: {where}: {problem.message}", "error": "malformed"}
    return None


def _validator(schema: dict[str, Any]) -> Any:
    key = json.dumps(schema, sort_keys=True, default=str)
    validator = _VALIDATORS.get(key)
    if validator is None:
        from jsonschema import Draft202012Validator

        validator = Draft202012Validator(schema)
        if len(_VALIDATORS) < _CACHED:
            _VALIDATORS[key] = validator
    return validator


def _close(env: Any) -> None:
    # an environment that fails to clean up costs the run nothing more
    with contextlib.suppress(Exception):
        env.close()
