"""The application layer: the `nvalchemi-jaxbridge` CLI, the main MD job, validation and reports.

It holds no logic the layers below should own; each module drives them for one command.
"""
