"""One-off measurements behind design decisions, kept so that they can be run again; not part of
the product and not run by ``duomo bench`` or the tests. What each measured: ``README.md`` here.
"""
