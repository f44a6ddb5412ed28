"""Glue between the services and the controller: controller workers that hold a service.

A worker composes abilities (an engine, a weight sender, a store client) rather than
inheriting them; services never import this package.
"""
