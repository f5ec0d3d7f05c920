"""NCCL's name filters: how NCCL reads ``NCCL_IB_HCA`` and ``NCCL_SOCKET_IFNAME``, and which interfaces it picks
when the latter is unset (the pre-flight checks in :mod:`het_plugin.core.nccl_env` decide with them). Pure."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

# A port (written here, not copied) of how NCCL reads NCCL_IB_HCA and NCCL_SOCKET_IFNAME, read in NVIDIA/nccl
# v2.30.7-1: src/misc/utils.cc parseStringList / matchIf / matchPort / matchIfList, the '^' and '=' prefixes in
# src/transport/net_ib/init.cc (NCCL_IB_HCA, at most MAX_IB_DEVS = 32 entries) and src/os/linux.cc
# ncclOsFindInterfaces (interfaces, MAX_IFS = 16 entries, port never compared). The same code since v2.17.
# What it does, and this port with it:
# * a leading '^' excludes, then a leading '=' asks for exact names (so '^=' both; '=^' is the name '^...');
#   nothing is stripped (' mlx5_0' is a name starting with a space);
# * entries split on ',' (empty entries skipped); an entry is name[:port[:rail[:plane]]], an empty name skips
#   the entry, the name is cut to 63 characters (a char[64] buffer), and the port is C's atoi of its field
#   (-1 when absent or empty: any port; 'x' gives 0, which no port has);
# * a name matches by prefix unless exact ('mlx5_1' selects mlx5_10 too; '=mlx5_1' only mlx5_1);
# * no entry at all selects everything, so '^' alone excludes everything and '=' alone selects everything.

PREFIX_MAX = 63
MAX_IB_DEVS = 32
MAX_IFS = 16


def c_atoi(text: str) -> int:
    """C's atoi: leading whitespace, a sign, digits; 0 when there are none."""
    i, n = 0, len(text)
    while i < n and text[i] in " \t\n\v\f\r":
        i += 1
    sign = 1
    if i < n and text[i] in "+-":
        sign = -1 if text[i] == "-" else 1
        i += 1
    j = i
    while j < n and "0" <= text[j] <= "9":
        j += 1
    return sign * int(text[i:j]) if j > i else 0


@dataclass(frozen=True)
class NameFilter:
    """``NCCL_IB_HCA`` / ``NCCL_SOCKET_IFNAME`` as NCCL reads them: ``[^][=]name[:port],...``.
    ``tokens``: (name, port) with port None for 'any port'."""
    text: str
    exclude: bool
    exact: bool
    tokens: tuple[tuple[str, Optional[int]], ...]

    @classmethod
    def parse(cls, text: str, ports: bool = True, max_entries: Optional[int] = None) -> "NameFilter":
        rest = text
        exclude = rest.startswith("^")
        rest = rest[1:] if exclude else rest
        exact = rest.startswith("=")
        rest = rest[1:] if exact else rest
        limit = max_entries if max_entries is not None else (MAX_IB_DEVS if ports else MAX_IFS)
        tokens: list[tuple[str, Optional[int]]] = []
        for entry in rest.split(","):
            if len(tokens) >= limit:
                break
            if entry == "":
                continue
            fields = entry.split(":")
            name = fields[0]
            if name == "":
                continue
            port = None
            if len(fields) > 1 and fields[1] != "":
                port = c_atoi(fields[1])
                port = None if port == -1 else port
            tokens.append((name[:PREFIX_MAX], port if ports else None))
        return cls(text, exclude, exact, tuple(tokens))

    def token_matches(self, token: tuple[str, Optional[int]], name: str, port: Optional[int] = None) -> bool:
        tname, tport = token
        hit = name == tname if self.exact else name.startswith(tname)
        return hit and (tport is None or port is None or tport == port)

    def selects(self, name: str, port: Optional[int] = None) -> bool:
        hit = not self.tokens or any(self.token_matches(t, name, port) for t in self.tokens)
        return hit != self.exclude


def nccl_auto_interfaces(interfaces: Sequence[str]) -> list[str]:
    """The interfaces NCCL picks when ``NCCL_SOCKET_IFNAME`` is unset (or one character long): ``ib*`` (IPoIB)
    first, else any but docker/lo/virbr, else docker, lo, virbr (NVIDIA/nccl v2.30.7-1 src/misc/socket.cc
    ncclFindInterfaces; the NCCL_COMM_ID subnet step between the first two is not modelled). Used for NCCL's
    bootstrap, the Socket network and the IB plugin's out-of-band address."""
    for pattern in ("ib", "^docker,lo,virbr", "docker", "lo", "virbr"):
        flt = NameFilter.parse(pattern, ports=False)
        found = [i for i in interfaces if flt.selects(i)]
        if found:
            return found
    return []


def socket_ifname_value(env: Mapping[str, str]) -> Optional[str]:
    """NCCL_SOCKET_IFNAME as NCCL uses it: None when unset or at most one character (src/misc/socket.cc reads
    it only when ``strlen(env) > 1``)."""
    value = env.get("NCCL_SOCKET_IFNAME")
    return value if value is not None and len(value) > 1 else None
