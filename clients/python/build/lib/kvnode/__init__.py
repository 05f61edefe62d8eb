"""kvnode: a pure-Python client for the kvnode daemon and an SGLang HiCache backend."""

from kvnode.wire import Connection, KvnodeError, Region

__all__ = ["Connection", "KvnodeError", "Region"]
