"""Glue between the services and the controller: controller workers that hold a service.

A worker composes abilities (an engine, a weight sender, a store client) rather than
inheriting them; services never import this package. :mod:`polyrl.workers.rollout_server` is
the rollout replica process: the rollout server composed with the weight-transfer routes.
"""
