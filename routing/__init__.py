"""Routing: the prefix input, features and the routers that assign documents to paths."""

from dipaco.routing.router import Router
from dipaco.routing.fit import fit_router

__all__ = ["Router", "fit_router"]
