"""The worked solutions of the notebooks' exercises (notebooks/solutions/), executed top to bottom as a student
opens them, an assert on every verdict ("right") and prediction ("match"). A file of their own, so that
pytest-xdist runs them beside tests/test_notebooks.py, on a quick course run of their own."""
import pytest

from conftest import ONE_THREAD
from test_notebooks import NOTEBOOKS_DIR, SOLUTIONS, execute

QUICK = {"MARS_QUICK": "course_quick_solutions"}  # not test_notebooks.py's folder: the two run at once


@pytest.mark.slow
@pytest.mark.parametrize("name", SOLUTIONS)
def test_solutions_run(name):
    execute(NOTEBOOKS_DIR / "solutions" / name, {**ONE_THREAD, **QUICK})  # raises CellExecutionError on a failed one
