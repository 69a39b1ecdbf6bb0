"""Routing: prefix features and the k-means router that assigns documents to paths."""

from dipaco.routing.router import Router

__all__ = ["Router"]
