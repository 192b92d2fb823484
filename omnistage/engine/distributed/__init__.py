"""Engines beyond one process, on Ray: data-parallel replicas behind one facade.

Above the stage engine: it builds whole engines (``engine.factory``) inside
Ray actors and drives them through the stage-engine interface; nothing below
it imports this package.
"""
