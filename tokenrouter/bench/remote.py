"""Generated code and its tests in two processes: the candidate's process runs the generated program and
answers requests about the objects it defines; the checker's process runs the task's tests against proxies of
those objects and alone holds the verdict pipe and its nonce. What crosses between them is plain data (numbers,
strings, bytes, lists, tuples, dicts, sets, None) or a handle to an object that stays in the candidate's
process, so no code of the candidate's ever runs where the verdict is written: it can answer wrongly or not at
all, but cannot write the verdict, read the nonce, or hand the tests an object whose `__eq__` it chose.

Run by the sandbox (`bench/sandbox.py`), each side in its own bubblewrap sandbox, as a script of the standard
library only:

    python -I remote.py serve solution.py FD_IN FD_OUT
    python -I remote.py check solution.py test.py helpers.py ENTRY_POINT FD_IN FD_OUT VERDICT_FD NONCE_FD

What the proxies support (what HumanEval-style tests do with a candidate): calling it, its attributes,
`len`, iteration, indexing, `in`, `bool`, `str` and `repr`. Arguments go over as copies; after a call the
candidate's changes to a list, dict, set or bytearray argument are copied back into the test's object. A
test cannot pass the candidate a function or another object of its own (a TypeError names it), and a handle
compares equal only to itself."""
from __future__ import annotations

import builtins
import json
import os
import sys
import traceback

MAX_MESSAGE = 16 << 20
MAX_DEPTH = 200
OPS = ("global", "call", "getattr", "setattr", "len", "iter", "next", "getitem", "setitem", "delitem", "contains",
       "bool", "str", "repr")
# checker exit statuses the sandbox reads (1 is a failing test, with its traceback on stderr)
CANDIDATE_ENDED, BAD_MESSAGE, SYNTAX_ERROR = 3, 4, 5


class ProtocolError(Exception):
    """The candidate's process sent something that is not a well-formed answer."""


class CandidateEnded(BaseException):
    """The candidate's process ended (or exited) before it answered; no test may catch this."""


# ---- values on the wire -------------------------------------------------------------------------------------
def encode(value, ref=None, depth: int = 0):
    """A JSON-able form of `value`: plain data as itself, containers tagged, anything else a handle from
    `ref(value)` (None: not allowed, TypeError). A subclass of a built-in type goes over as that type's value
    (a `Counter` as a dict, a namedtuple as a tuple), so its own `__eq__` stays behind."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if value is None or type(value) is bool:
        return value
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, list):
        return [encode(v, ref, depth + 1) for v in list.__iter__(value)]
    if isinstance(value, tuple):
        return {"tuple": [encode(v, ref, depth + 1) for v in tuple.__iter__(value)]}
    if isinstance(value, dict):
        return {"dict": [[encode(k, ref, depth + 1), encode(v, ref, depth + 1)] for k, v in dict.items(value)]}
    for kind in (set, frozenset):
        if isinstance(value, kind):
            return {kind.__name__: [encode(v, ref, depth + 1) for v in kind.__iter__(value)]}
    for kind in (bytes, bytearray):
        if isinstance(value, kind):
            return {kind.__name__: kind.hex(value)}
    if isinstance(value, complex):
        return {"complex": [complex.__getattribute__(value, "real"), complex.__getattribute__(value, "imag")]}
    if type(value) is Remote:
        return {"ref": object.__getattribute__(value, "_ref")}
    if ref is None:
        raise TypeError(f"the tests cannot pass a {type(value).__name__} to generated code (only plain data and "
                        "its own objects)")
    return {"ref": ref(value)}


def decode(data, ref, depth: int = 0):
    """The value `encode` made; `ref(id)` turns a handle into an object. Raises ProtocolError on anything else."""
    if depth > MAX_DEPTH:
        raise ProtocolError("value nested too deeply")
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is list:
        return [decode(v, ref, depth + 1) for v in data]
    if type(data) is not dict or len(data) != 1:
        raise ProtocolError(f"not a value: {str(data)[:80]}")
    (tag, body), = data.items()
    try:
        if tag == "ref" and type(body) is int:
            return ref(body)
        if tag in ("bytes", "bytearray") and type(body) is str:
            return (bytes if tag == "bytes" else bytearray).fromhex(body)
        if tag == "complex" and type(body) is list and len(body) == 2 and all(type(x) is float for x in body):
            return complex(*body)
        if type(body) is not list:
            raise ProtocolError(f"not a value: {tag!r}")
        items = [decode(v, ref, depth + 1) for v in body]
        if tag == "tuple":
            return tuple(items)
        if tag in ("set", "frozenset"):
            return (set if tag == "set" else frozenset)(items)
        if tag == "dict" and all(type(p) is list and len(p) == 2 for p in items):
            return dict(items)
    except TypeError as e:  # an unhashable key or member
        raise ProtocolError(f"not a value: {e}") from None
    raise ProtocolError(f"not a value: {tag!r}")


MUTABLE = (list, dict, set, bytearray)


def restore(original, state) -> None:
    """Copy the candidate's changes to a mutable argument back into the test's object, keeping the identity
    of the containers inside it where their shapes still match."""
    kind = type(original)
    if kind is not type(state):
        return
    if kind in (list, tuple) and len(original) == len(state):
        for i, (o, s) in enumerate(zip(original, state)):
            if type(o) in (*MUTABLE, tuple) and type(o) is type(s):
                restore(o, s)
            elif kind is list:
                original[i] = s
    elif kind is dict and original.keys() == state.keys():
        for k, s in state.items():
            if type(original[k]) in (*MUTABLE, tuple) and type(original[k]) is type(s):
                restore(original[k], s)
            else:
                original[k] = s
    elif kind in (list, bytearray):
        original[:] = state
    elif kind in (dict, set):
        original.clear()
        original.update(state)


# ---- the checker's side -------------------------------------------------------------------------------------
class Connection:
    def __init__(self, fd_in: int, fd_out: int):
        self.inp, self.out = os.fdopen(fd_in, "rb"), os.fdopen(fd_out, "wb")
        self.refs: dict[int, Remote] = {}

    def receive(self) -> dict:
        line = self.inp.readline(MAX_MESSAGE + 1)
        if not line:
            raise CandidateEnded("generated code ended before it answered")
        if len(line) > MAX_MESSAGE or not line.endswith(b"\n"):
            raise ProtocolError("an answer longer than the limit, or cut off")
        try:
            message = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise ProtocolError(f"not JSON: {e}") from None
        if type(message) is not dict or len(message) < 1:
            raise ProtocolError("not an answer")
        return message

    def remote(self, ref: int) -> "Remote":
        if ref not in self.refs:
            proxy = object.__new__(Remote)
            object.__setattr__(proxy, "_ref", ref)
            object.__setattr__(proxy, "_conn", self)
            self.refs[ref] = proxy
        return self.refs[ref]

    def request(self, op: str, ref, *args, **kwargs):
        message = {"op": op, "ref": ref, "args": [encode(a) for a in args],
                   "kwargs": {k: encode(v) for k, v in kwargs.items()}}
        try:
            self.out.write(json.dumps(message).encode() + b"\n")
            self.out.flush()
        except (BrokenPipeError, OSError):
            raise CandidateEnded("generated code ended before it answered") from None
        answer = self.receive()
        if "ok" in answer:
            value = decode(answer["ok"], self.remote)
            states = answer.get("args", [])
            if type(states) is not list or len(states) != len(args) + len(kwargs):
                raise ProtocolError("argument states do not match the call")
            for original, state in zip([*args, *kwargs.values()], states):
                restore(original, decode(state, self.remote))
            return value
        if "raise" in answer:
            raise remote_exception(answer["raise"])
        if "exited" in answer:
            raise CandidateEnded(f"generated code exited (exit code {answer['exited']!r})")
        raise ProtocolError("not an answer")


HELPERS: dict = {}  # the tests' namespace: exception classes the task's prompt defines are raised by name


def remote_exception(info) -> BaseException:
    """The exception the candidate raised, as an exception of the checker's: the task's own class of that name,
    else the first built-in class in its MRO; its traceback in the candidate is printed with a failing test."""
    if type(info) is not dict or type(info.get("mro")) is not list or type(info.get("message")) is not str:
        raise ProtocolError("not an exception")
    cls = Exception
    for name in info["mro"]:
        found = HELPERS.get(name) if type(name) is str else None
        if not (isinstance(found, type) and issubclass(found, BaseException)):
            found = getattr(builtins, name, None) if type(name) is str else None
        if isinstance(found, type) and issubclass(found, BaseException):
            cls = found
            break
    try:
        error = cls(info["message"])
    except Exception:
        error = Exception(info["message"])
    error.candidate_traceback = str(info.get("traceback", ""))[-4000:]
    return error


class Remote:
    """An object of the generated code's, answered by its process."""
    __slots__ = ("_ref", "_conn")

    def _ask(self, op, *args, **kwargs):
        return object.__getattribute__(self, "_conn").request(op, object.__getattribute__(self, "_ref"),
                                                              *args, **kwargs)

    def __call__(self, *args, **kwargs):
        return self._ask("call", *args, **kwargs)

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return self._ask("getattr", name)

    def __setattr__(self, name, value):
        self._ask("setattr", name, value)

    def __len__(self):
        return _typed(self._ask("len"), int, "__len__")

    def __iter__(self):
        return _typed(self._ask("iter"), Remote, "__iter__")

    def __next__(self):
        return self._ask("next")

    def __getitem__(self, key):
        return self._ask("getitem", key)

    def __setitem__(self, key, value):
        self._ask("setitem", key, value)

    def __delitem__(self, key):
        self._ask("delitem", key)

    def __contains__(self, item):
        return _typed(self._ask("contains", item), bool, "__contains__")

    def __bool__(self):
        return _typed(self._ask("bool"), bool, "__bool__")

    def __str__(self):
        return _typed(self._ask("str"), str, "__str__")

    def __repr__(self):
        return _typed(self._ask("repr"), str, "__repr__")


def _typed(value, kind, what):
    if type(value) is not kind:
        raise TypeError(f"{what} of generated code returned {type(value).__name__}, not {kind.__name__}")
    return value


def check(source_path, test_path, helpers_path, entry_point, fd_in, fd_out, verdict_fd, nonce_fd) -> int:
    """The checker: compile the candidate's program (never running it: a syntax error is this process's
    finding, not a message the candidate's process could forge), wait until the program has run in its own
    process, then run the tests against its entry point; the nonce goes to the verdict pipe only when every
    test returned."""
    conn = Connection(fd_in, fd_out)
    try:
        try:
            compile(open(source_path).read(), "solution.py", "exec")  # as `serve` compiles it
        except (SyntaxError, ValueError) as e:  # ValueError: a null byte (a SyntaxError from Python 3.12)
            print("".join(traceback.format_exception_only(type(e), e)), file=sys.stderr, end="")
            return SYNTAX_ERROR
        hello = conn.receive()
        if "exited" in hello:
            print(f"generated code exited before the end of its program (exit code {hello['exited']!r})",
                  file=sys.stderr)
            return CANDIDATE_ENDED
        if "failed" in hello:
            print(str(hello["failed"])[-8000:], file=sys.stderr, end="")
            return 1
        if hello != {"ready": True}:
            raise ProtocolError("not a greeting")
        if entry_point:
            HELPERS["__name__"] = "__main__"
            try:  # the task's prompt: helpers its tests may call (an unfinished prompt defines nothing)
                exec(compile(open(helpers_path).read(), "prompt.py", "exec"), HELPERS)
            except Exception:
                pass
            candidate = conn.request("global", None, entry_point)
            HELPERS[entry_point] = candidate
            exec(compile(open(test_path).read(), "test.py", "exec"), HELPERS)
            HELPERS["check"](candidate)
    except CandidateEnded as e:
        print(f"{e}", file=sys.stderr)
        return CANDIDATE_ENDED
    except ProtocolError as e:
        print(f"bad answer from generated code: {e}", file=sys.stderr)
        return BAD_MESSAGE
    except BaseException as e:
        remote = getattr(e, "candidate_traceback", "")
        if remote:
            print(f"in generated code:\n{remote}", file=sys.stderr)
        print("".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next)), file=sys.stderr, end="")
        return 1
    os.write(verdict_fd, os.read(nonce_fd, 64))
    return 0


# ---- the candidate's side -----------------------------------------------------------------------------------
def serve(source_path, fd_in, fd_out) -> int:
    """Run the generated program, say whether it ran to the end, then answer the checker's requests."""
    inp, out = os.fdopen(fd_in, "rb"), os.fdopen(fd_out, "wb")
    objects: dict[int, object] = {}
    me = os.getpid()

    def ref(value) -> int:
        objects[id(value)] = value
        return id(value)

    def send(message) -> None:
        if os.getpid() != me:  # NOTE: a process the program forked never answers for it
            os._exit(1)
        out.write(json.dumps(message).encode() + b"\n")
        out.flush()

    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(open(source_path).read(), "solution.py", "exec"), namespace)
    except SystemExit as e:
        send({"exited": e.code if type(e.code) in (int, str) or e.code is None else str(e.code)})
        return 0
    except BaseException as e:
        send({"failed": "".join(_format(e, skip=1))})
        return 1
    send({"ready": True})
    handlers = {
        "global": lambda _, name: namespace[name], "call": lambda o, *a, **k: o(*a, **k), "getattr": getattr,
        "setattr": setattr, "len": len, "iter": iter, "next": next, "getitem": lambda o, k: o[k],
        "setitem": lambda o, k, v: o.__setitem__(k, v), "delitem": lambda o, k: o.__delitem__(k),
        "contains": lambda o, item: item in o, "bool": bool, "str": str, "repr": repr}
    for line in inp:
        request = json.loads(line)
        take = objects.__getitem__
        args = [decode(a, take) for a in request["args"]]
        kwargs = {k: decode(v, take) for k, v in request["kwargs"].items()}
        target = None if request["ref"] is None else objects[request["ref"]]
        try:
            value = handlers[request["op"]](target, *args, **kwargs)
            answer = {"ok": encode(value, ref), "args": [encode(a, ref) for a in (*args, *kwargs.values())]}
        except SystemExit as e:
            send({"exited": e.code if type(e.code) in (int, str) or e.code is None else str(e.code)})
            return 0
        except BaseException as e:
            answer = {"raise": {"mro": [c.__name__ for c in type(e).__mro__], "message": _message(e),
                                "traceback": "".join(_format(e, skip=1))[-4000:]}}
        send(answer)
    return 0


def _message(e: BaseException) -> str:
    try:
        return str(e.args[0]) if len(e.args) == 1 else str(e)
    except Exception:
        return "<unprintable>"


def _format(e: BaseException, skip: int) -> list[str]:
    tb = e.__traceback__
    for _ in range(skip):
        tb = tb.tb_next if tb is not None else None
    return traceback.format_exception(type(e), e, tb)


if __name__ == "__main__":
    command, *argv = sys.argv[1:]
    if command == "serve":
        sys.exit(serve(argv[0], int(argv[1]), int(argv[2])))
    sys.exit(check(argv[0], argv[1], argv[2], argv[3], *map(int, argv[4:8])))
