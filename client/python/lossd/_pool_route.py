# SPDX-License-Identifier: Apache-2.0
"""Where a replica pool sends a key: rendezvous hashing, and the replicas a target names.

The hashing and the key strings are a contract shared with the C++ client (docs/replica_pool.md):
a C++ trainer and a Python trainer of one job send the same key to the same replica, so every
detail here (byte order, the separator, ties) is fixed, and tests assert its vectors.
"""

import ipaddress
import socket

from lossd import errors

_MASK = (1 << 64) - 1
_FNV_OFFSET = 0xcbf29ce484222325
_FNV_PRIME = 0x100000001b3


def fnv1a64(data: bytes) -> int:
    h = _FNV_OFFSET
    for b in data:
        h ^= b
        h = (h * _FNV_PRIME) & _MASK
    return h


def splitmix64_finalize(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & _MASK
    return z ^ (z >> 31)


def score(key: str, endpoint: str) -> int:
    """The rendezvous score of `key` on `endpoint` (both as UTF-8 strings)."""
    return splitmix64_finalize(fnv1a64(key.encode() + b"\x00" + endpoint.encode()))


def rendezvous_order(key, endpoints):
    """The endpoints by descending score for `key` (ties: the smaller endpoint string first):
    the key's owner first, then its failover order."""
    return sorted(set(endpoints), key=lambda e: (-score(key, e), e))


def order_after_loss(key, endpoints, lost_on):
    """Where a key's state goes after it was lost on `lost_on` (unreachable, or restarted: its
    instance changed): every endpoint but `lost_on`, beginning with the one after it in the
    key's order over `endpoints` and `lost_on`, wrapping around. A function of the replica
    list and the replica that lost the state only, so every pool that meets the loss, in
    whatever order and whatever it saw before, names the same new home, and the replica that
    lost it is never that home even when it is back (restarted, empty). Empty when `lost_on`
    is the only endpoint. The C++ client's OrderAfterLoss is the same function."""
    order = rendezvous_order(key, set(endpoints) | {lost_on})
    at = order.index(lost_on)
    return order[at + 1:] + order[:at]


def key_of(kind, name):
    """The pool's key strings: weights:<name>, acc:<name>, head:<name>, rank:<rank>."""
    if kind not in ("weights", "acc", "head", "rank"):
        raise errors.InvalidArgumentError("key kind must be weights, acc, head or rank, got %r"
                                          % (kind,))
    return "%s:%s" % (kind, name)


def format_endpoint(ip, port):
    """ip:port, or [ip]:port for IPv6 (the form keys are hashed with)."""
    return "[%s]:%d" % (ip, port) if ":" in ip else "%s:%d" % (ip, port)


def _split_host_port(text, field):
    """("host", port) of "host:port" / "[v6]:port"; errors name `field`."""
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise errors.InvalidArgumentError("%s: %r is not [ipv6]:port" % (field, text))
        port = rest[1:]
    else:
        host, sep, port = text.rpartition(":")
        if not sep or not host:
            raise errors.InvalidArgumentError("%s: %r is not host:port" % (field, text))
        if ":" in host:
            raise errors.InvalidArgumentError(
                "%s: %r: write an IPv6 address as [addr]:port" % (field, text))
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise errors.InvalidArgumentError("%s: %r has no port in [1, 65535]" % (field, text))
    return host, int(port)


def _ip_literal(host):
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


class Target:
    """What a pool was pointed at: fixed replicas ("ip:port,ip:port", or a list), or one name
    to resolve ("dns:///name:port", "name:port") into one replica per address record."""

    def __init__(self, endpoints):
        field = "endpoints"
        if isinstance(endpoints, str):
            text = endpoints.strip()
            items = [s.strip() for s in text.split(",")] if "," in text else [text]
        elif isinstance(endpoints, (list, tuple)):
            items = [str(s).strip() for s in endpoints]
        else:
            raise errors.InvalidArgumentError(
                "endpoints must be a string or a list of 'host:port', got %r" % (endpoints,))
        if not items or any(not s for s in items):
            raise errors.InvalidArgumentError("%s: an empty entry in %r" % (field, endpoints))
        self.name = None  # (host, port) to resolve, or None for fixed replicas
        self.fixed = []
        if len(items) == 1:
            one = items[0]
            explicit_dns = one.startswith("dns:///")
            host, port = _split_host_port(one[len("dns:///"):] if explicit_dns else one, field)
            ip = _ip_literal(host)
            if ip is None or explicit_dns:
                self.name = (host, port)
            else:
                self.fixed = [format_endpoint(ip, port)]
            return
        for s in items:
            if s.startswith("dns:///"):
                raise errors.InvalidArgumentError(
                    "%s: %r: a dns:/// name stands alone (it resolves to every replica)" % (
                        field, s))
            host, port = _split_host_port(s, field)
            ip = _ip_literal(host)
            # A list names its replicas as given (hashed by these strings); literal IPs are
            # normalised so that "::1" and "0:0::1" are one replica.
            self.fixed.append(format_endpoint(ip, port) if ip else "%s:%d" % (host, port))
        if len(set(self.fixed)) != len(self.fixed):
            raise errors.InvalidArgumentError("%s: a replica listed twice in %r" % (
                field, endpoints))

    @property
    def resolves(self):
        return self.name is not None

    def describe(self):
        return "%s:%d" % self.name if self.name else ",".join(self.fixed)


def system_resolver(host, port):
    """Every A/AAAA record of `host` (socket.getaddrinfo), as IP strings."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise errors.UnavailableError("cannot resolve %r: %s" % (host, e),
                                      method="resolve") from None
    return [info[4][0] for info in infos]


def resolve(target, resolver):
    """The target's replicas as sorted "ip:port" strings (deduplicated)."""
    if not target.resolves:
        return list(target.fixed)
    host, port = target.name
    got = resolver(host, port)
    if isinstance(got, str) or not hasattr(got, "__iter__"):
        raise errors.InvalidArgumentError(
            "resolver(%r, %d) must return a list of IP addresses, got %r" % (host, port, got))
    out = set()
    for ip in got:
        lit = _ip_literal(str(ip).split("%")[0])
        if lit is None:
            raise errors.InvalidArgumentError(
                "resolver(%r, %d) returned %r, not an IP address" % (host, port, ip))
        out.add(format_endpoint(lit, port))
    return sorted(out)


__all__ = ["score", "rendezvous_order", "order_after_loss", "key_of", "Target", "resolve", "system_resolver",
           "format_endpoint", "fnv1a64", "splitmix64_finalize"]
