"""Helpers shared by the tests: imported as ``tests.support.<module>``; the ``*_cases`` modules
run as ``python -m tests.support.<module>`` in a child process (see ``tests.support.gdn``)."""
