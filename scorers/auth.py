"""The reward server's shared token, read alike by the server (scorers/server.py, `--token-file`)
and its clients (scorers/remote.py, `--reward-token-file`): from a file, or else from the variable
MARGRPO_REWARD_TOKEN; checked; and held as a `Secret`, which never prints its value.

A token is 16 to 4096 printable ASCII characters without spaces (what `python -c 'import secrets;
print(secrets.token_urlsafe(32))'` prints); white space around it (a file's last newline) is
dropped. Whatever a file or the variable holds (newlines, control characters, other scripts, a
megabyte, nothing), an error names the flag and the file, or the variable, and says what is wrong
with it, never what it holds.
"""

import errno
import hmac
import os
import stat

from scorers import wire

TOKEN_ENV = wire.TOKEN_ENV
MIN_TOKEN, MAX_TOKEN = 16, 4096     # characters
MAX_FILE = 1 << 16                  # bytes read of a token file at most (the token and white space)
RULE = (f"the token must be {MIN_TOKEN} or more printable ASCII characters without spaces "
        f"(at most {MAX_TOKEN}; e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")


class Secret:
    """A token that prints as where it came from: str(), repr() and f-strings never show its value.

    value: the token (checked by `check`); source: where it was read, e.g. 'MARGRPO_REWARD_TOKEN'.
    """

    __slots__ = ("_value", "source")

    def __init__(self, value, source):
        self._value, self.source = value, source

    def reveal(self):
        """The token itself (str), for the Authorization header and nothing else."""
        return self._value

    def matches(self, given):
        """True if `given` (bytes of a request's header) is the token, compared in constant time."""
        return hmac.compare_digest(given, self._value.encode("ascii"))

    def redact(self, text):
        """`text` with every copy of the token replaced by its name (a peer may echo the header)."""
        return text.replace(self._value, f"<the token of {self.source}>")

    def __repr__(self):
        return f"<the token of {self.source}>"

    __str__ = __repr__

    def __format__(self, spec):
        return format(repr(self), spec)


def check(text, where):
    """`text` (str) as a token, white space around it dropped. Returns a Secret from `where`; a
    one-line ValueError naming `where` (never the text) if it is empty or not a token."""
    token = text.strip()
    if not token:
        if where == TOKEN_ENV:
            raise ValueError(f"{where}: set, but empty (or white space only): set it to the "
                             "server's token, or unset it")
        raise ValueError(f"{where}: empty (or white space only); it must hold the token")
    if not MIN_TOKEN <= len(token) <= MAX_TOKEN or not all(33 <= ord(c) < 127 for c in token):
        raise ValueError(f"{where}: {RULE}")
    return Secret(token, where)


def read_file(path, where):
    """The text of the token file `path` (a regular file, or a pipe such as bash's <(...)), at most
    MAX_FILE bytes of it. One-line errors naming `where`: FileNotFoundError if it is missing,
    ValueError if it cannot be read, is a folder or a device, is too long or is not UTF-8."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno == errno.ENOENT:
            raise FileNotFoundError(f"{where}: no such file") from None
        raise ValueError(f"{where}: cannot open it ({e.strerror})") from None
    try:
        kind = os.fstat(fd).st_mode
        if not (stat.S_ISREG(kind) or stat.S_ISFIFO(kind)):
            raise ValueError(f"{where}: not a file (a folder, a device or a socket)")
        os.set_blocking(fd, True)  # a pipe's writer may not have written yet
        data = b""
        while len(data) <= MAX_FILE:
            part = os.read(fd, MAX_FILE + 1 - len(data))
            if not part:
                break
            data += part
    except OSError as e:
        raise ValueError(f"{where}: cannot read it ({e.strerror})") from None
    finally:
        os.close(fd)
    if len(data) > MAX_FILE:
        raise ValueError(f"{where}: over {MAX_FILE} bytes; a token file holds the token alone")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{where}: not text (UTF-8); {RULE}") from None


def read(path, flag, environ=None):
    """The token of a process: from the file `path` if given (`flag` names it in errors), else from
    MARGRPO_REWARD_TOKEN in `environ` (default: os.environ). Returns a Secret, or None when there is
    no file and the variable is not set. A variable set to nothing is an error, not 'no token'."""
    environ = os.environ if environ is None else environ
    if path is not None:
        where = f"{flag} {wire.one_line(os.fspath(path))}"
        return check(read_file(path, where), where)
    if TOKEN_ENV not in environ:
        return None
    return check(environ[TOKEN_ENV], TOKEN_ENV)
