"""Prefect flows around the components, and the pipeline that chains them.

Before any flow module imports Prefect, this package activates lmforge's Prefect environment
(flows/prefect_env.py): the user's own Prefect (PREFECT_API_URL, PREFECT_HOME or an active
profile), else the server `lmforge prefect up` started, else an embedded home in
<workspace>/prefect. It only sets environment variables; nothing is written until work runs.

    from lmforge.flows import prefect_env
    print(prefect_env.activate().describe())   # prefect: embedded home /x/.lmforge/prefect (no PREFECT_API_URL, ...)
"""

import logging
import os

from lmforge.components.errors import UserError
from lmforge.flows import prefect_env, quiet

prefect_env.activate()   # must precede `import prefect`, which freezes Prefect's settings
if os.environ.get(quiet.ENV_VERBOSE) == "0":  # a child of a quiet `lmforge` (a Prefect worker's run, a Dask worker)
    quiet.configure(verbose=False)


class _UserErrorsWithoutTraceback(logging.Filter):
    """A UserError is reported on one line by the CLI; Prefect's traceback of it is noise, so drop it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], UserError):
            record.exc_info, record.exc_text = None, None
        return True


for _name in ("prefect.flow_runs", "prefect.task_runs"):
    logging.getLogger(_name).addFilter(_UserErrorsWithoutTraceback())
