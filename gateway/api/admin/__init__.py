"""Operator routes: weights, replicas and status under the admin token; health and readiness."""
