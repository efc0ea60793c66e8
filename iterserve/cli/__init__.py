"""The command lines: ``iterserve`` (:mod:`.main`) and its ``bench``, ``plan`` and ``simulate`` commands.

Every argparse parser of the package lives here, and nothing outside this package imports from it.
"""
