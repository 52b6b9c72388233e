"""The web app's logins: names, roles and scrypt-hashed passwords, never a password in clear.

    python -m app.users add alice                  # operator; the password is asked for (or read from stdin)
    python -m app.users add bob --role viewer      # may watch and chat, not change a run
    python -m app.users remove bob
    python -m app.users list

The file (default `<output dir>/.users`, or --file / LIVETUNE_USERS_FILE) has one line per login,
`name:role:scrypt$n$r$p$salt$hash`, and must be mode 0600 (the app refuses to read it otherwise,
as ssh does a private key). Passwords are hashed with the standard library's `hashlib.scrypt`
(a memory-hard key derivation function) under a random salt per login, and compared in constant
time. A single operator login can instead come from the environment, LIVETUNE_USERNAME and
LIVETUNE_PASSWORD: the app hashes the password at start and removes it from its environment, so the
runs it starts do not inherit it. Never on the command line: every user of the machine can read
another's command line (`ps`). Roles: contract.protocol.roles.
"""

from __future__ import annotations

import argparse
import base64
import getpass
import hashlib
import hmac
import os
import secrets
import stat
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from pathlib import Path

from contract.protocol.roles import ROLES, Role

USERS_FILE = ".users"            # in the output folder, unless LIVETUNE_USERS_FILE or --file says
ENV_FILE, ENV_NAME, ENV_PASSWORD = "LIVETUNE_USERS_FILE", "LIVETUNE_USERNAME", "LIVETUNE_PASSWORD"
# scrypt's cost: 16 MiB and ~50 ms per login on a laptop core (RFC 7914's interactive setting)
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**14, 8, 1


class UsersError(ValueError):
    """A users file or a login that cannot be used; the message says what to do."""


def hash_password(password: str) -> str:
    """`scrypt$n$r$p$salt$hash` of `password` under a fresh random salt."""
    salt = secrets.token_bytes(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P, dklen=32)
    b64 = base64.b64encode
    return f"scrypt${SCRYPT_N}${SCRYPT_R}${SCRYPT_P}${b64(salt).decode()}${b64(digest).decode()}"


def verify_password(password: str, stored: str) -> bool:
    """Whether `password` is the one `stored` (hash_password's form) was made from; constant time."""
    try:
        scheme, n, r, p, salt, digest = stored.split("$")
        if scheme != "scrypt":
            return False
        expected = base64.b64decode(digest)
        got = hashlib.scrypt(password.encode(), salt=base64.b64decode(salt), n=int(n), r=int(r), p=int(p),
                             dklen=len(expected))
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(got, expected)


@dataclass
class Users:
    """Logins by name: (role, password hash). `check` is the web app's login (Gradio's `auth`)."""

    logins: dict[str, tuple[Role, str]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.logins)

    def check(self, name: str, password: str) -> bool:
        """Whether `name` / `password` is a login (a wrong name costs as long as a wrong password)."""
        role_hash = self.logins.get(name)
        if role_hash is None:
            verify_password(password, _DUMMY)
            return False
        return verify_password(password, role_hash[1])

    def role(self, name: str | None) -> Role | None:
        """The role of login `name`, None for no such login."""
        found = self.logins.get(name or "")
        return found[0] if found else None

    def add(self, name: str, role: Role, password: str) -> None:
        if not name or ":" in name or name != name.strip():
            raise UsersError(f"login name {name!r}: not empty, no ':' and no surrounding spaces")
        if not password:
            raise UsersError(f"login {name}: the password must not be empty")
        self.logins[name] = (Role(role), hash_password(password))

    def text(self) -> str:
        return "".join(f"{name}:{role.value}:{hashed}\n" for name, (role, hashed) in sorted(self.logins.items()))


_DUMMY = hash_password(secrets.token_urlsafe(8))


def default_file(output_dir: str | Path) -> Path:
    """LIVETUNE_USERS_FILE, else `<output_dir>/.users`."""
    return Path(os.environ.get(ENV_FILE) or Path(output_dir) / USERS_FILE)


def read_users(path: str | Path) -> Users:
    """The logins in `path` (none if it does not exist); refused unless only its owner may read it."""
    path = Path(path)
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return Users()
    if mode & 0o077:
        raise UsersError(f"{path} is readable by others (mode {mode:04o}): run `chmod 600 {path}`")
    users = Users()
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        name, _, rest = line.partition(":")
        role, _, hashed = rest.partition(":")
        if role not in ROLES or not hashed.startswith("scrypt$"):
            raise UsersError(f"{path} line {n}: expected name:role:scrypt$..., with role one of "
                             f"{', '.join(ROLES)} (write it with `python -m app.users add`)")
        users.logins[name] = (Role(role), hashed)
    return users


def write_users(path: str | Path, users: Users) -> None:
    """Write `users` to `path`, mode 0600, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(users.text())
    os.replace(tmp, path)


def logins(output_dir: str | Path, users_file: str | Path | None = None,
           environ: MutableMapping[str, str] | None = None) -> Users:
    """The app's logins: the users file (`users_file`, else `default_file`), plus
    LIVETUNE_USERNAME / LIVETUNE_PASSWORD as an operator (the password is hashed here and removed
    from `environ`, os.environ by default)."""
    env: MutableMapping[str, str] = os.environ if environ is None else environ
    users = read_users(users_file or default_file(output_dir))
    name, password = env.get(ENV_NAME), env.pop(ENV_PASSWORD, None)
    if bool(name) != bool(password):
        raise UsersError(f"set both {ENV_NAME} and {ENV_PASSWORD}, or neither")
    if name and password:
        users.add(name, Role.OPERATOR, password)
    return users


def _read_password(name: str) -> str:
    if not sys.stdin.isatty():
        return sys.stdin.readline().rstrip("\n")
    first = getpass.getpass(f"password for {name}: ")
    if first != getpass.getpass("again: "):
        raise UsersError("the two passwords differ")
    return first


def main(argv: list[str] | None = None) -> int:
    """`python -m app.users add|remove|list`: manage the web app's logins."""
    parser = argparse.ArgumentParser(prog="python -m app.users", description=__doc__.split("\n\n")[0])
    parser.add_argument("--file", help=f"the users file (default: ${ENV_FILE}, else <output dir>/{USERS_FILE})")
    parser.add_argument("--output-dir", default=os.environ.get("LIVETUNE_OUTPUT_DIR", "runs"))
    sub = parser.add_subparsers(dest="action", required=True)
    add = sub.add_parser("add", help="add a login, or change its role and password (asked for, or one line of stdin)")
    add.add_argument("name")
    add.add_argument("--role", choices=ROLES, default=Role.OPERATOR.value)
    sub.add_parser("remove", help="remove a login").add_argument("name")
    sub.add_parser("list", help="the logins and their roles")
    args = parser.parse_args(argv)
    path = Path(args.file) if args.file else default_file(args.output_dir)
    try:
        users = read_users(path)
        if args.action == "list":
            for name, (role, _) in sorted(users.logins.items()):
                print(f"{name}\t{role.value}")
            return 0
        if args.action == "add":
            users.add(args.name, Role(args.role), _read_password(args.name))
        elif users.logins.pop(args.name, None) is None:
            raise UsersError(f"no login {args.name!r} in {path}")
        write_users(path, users)
    except UsersError as e:
        print(f"app.users: {e}", file=sys.stderr)
        return 1
    print(f"{path}: {args.action} {args.name}" + (f" ({args.role})" if args.action == "add" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
