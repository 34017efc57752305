"""Credentials of every kind the secret scan knows, made up at run time (so that no key-shaped
string is committed), and planting one into a real Pi session file where tools print them."""
from __future__ import annotations

import json
import random
import string

_rng = random.Random(15)


def _chars(n: int, alphabet: str = string.ascii_letters + string.digits) -> str:
    return "".join(_rng.choice(alphabet) for _ in range(n))


_B64URL = string.ascii_letters + string.digits + "_-"
_UPPER = string.ascii_uppercase + string.digits
PLANTED: list[tuple[str, str]] = [
    ("anthropic-key", "sk-" + "ant-api03-" + _chars(93, _B64URL) + "AA"),
    ("openai-key", "sk-" + "proj-" + _chars(120, _B64URL)),
    ("openai-key", "sk-" + _chars(48)),
    ("google-api-key", "AI" + "za" + _chars(35, _B64URL)),
    ("github-token", "gh" + "p_" + _chars(36)),
    ("github-token", "gh" + "o_" + _chars(36)),
    ("github-token", "github" + "_pat_" + _chars(22) + "_" + _chars(59)),
    ("gitlab-token", "gl" + "pat-" + _chars(20, _B64URL)),
    ("slack-token", "xo" + "xb-" + _chars(12, string.digits) + "-" + _chars(24)),
    ("stripe-key", "sk" + "_live_" + _chars(24)),
    ("aws-access-key-id", "AK" + "IA" + _chars(16, _UPPER)),
    ("aws-access-key-id", "AS" + "IA" + _chars(16, _UPPER)),
    ("aws-secret-key", "aws_secret" + "_access_key = " + _chars(40, string.ascii_letters + "/+")),
    ("npm-token", "np" + "m_" + _chars(36)),
    ("huggingface-token", "h" + "f_" + _chars(34)),
    ("private-key", "-----BEGIN OPENSSH " + "PRIVATE KEY-----\n"
     + "\n".join(_chars(70, _B64URL) for _ in range(5)) + "\n-----END OPENSSH " + "PRIVATE KEY-----\n"),
    ("password-in-url", "postgres" + "://app:" + _chars(18) + "@db.internal:5432/app"),
    ("jwt", "ey" + "JhbGciOiJIUzI1NiJ9." + "ey" + "JzdWIiOiIxMjM0In0." + _chars(43, _B64URL)),
]


def _target(obj: dict, where: str) -> tuple[dict, str, str] | None:
    """(the dict holding the string, its key, the string's JSON path) of the first place of this kind."""
    message = obj.get("message") if obj.get("type") == "message" else None
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return None
    role = {"toolResult": "toolResult", "user": "user", "bash": "assistant"}[where]
    if message.get("role") != role:
        return None
    for i, item in enumerate(message["content"]):
        if where == "bash" and item.get("type") == "toolCall" and item.get("name") == "bash":
            return item["arguments"], "command", f"message.content[{i}].arguments.command"
        if where != "bash" and item.get("type") == "text":
            return item, "text", f"message.content[{i}].text"
    return None


def plant(data: bytes, where: str, value: str) -> tuple[bytes, int, str]:
    """The session with `value` written into the first tool result ("toolResult"), user
    message ("user") or bash command ("bash"): (bytes, line number, JSON path)."""
    lines = data.split(b"\n")
    for n, line in enumerate(lines):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        found = _target(obj, where) if isinstance(obj, dict) else None
        if found is None:
            continue
        holder, key, path = found
        holder[key] = f"{holder[key]}\n[PLANTED] export KEY={value}\n"
        lines[n] = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
        return b"\n".join(lines), n + 1, path
    raise AssertionError(f"no {where} entry to plant into")
