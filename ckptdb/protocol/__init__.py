"""The protocol: what happens at a boundary, at a load, at reconciliation and at a check.

Each module owns one state machine or one step of it; the save phases are told
in :mod:`ckptdb.protocol.boundary`.
"""
