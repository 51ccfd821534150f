"""`Request.token_view`: prompt + output read without a copy, for the prefix
cache's block hashes; every slice must equal the same slice of `all_token_ids`."""

from hypothesis import given
from hypothesis import strategies as st

from kvforge.engine.request import Request
from kvforge.engine.sampling_params import SamplingParams

bound = st.one_of(st.none(), st.integers(-40, 40))


@given(prompt=st.lists(st.integers(0, 99), min_size=1, max_size=12), output=st.lists(st.integers(0, 99), max_size=12),
       start=bound, stop=bound, step=st.sampled_from([None, 1, 2, -1]))
def test_token_view_slices_like_all_token_ids(prompt, output, start, stop, step):
    request = Request("r", prompt, SamplingParams())
    request.output_token_ids = list(output)
    view, full = request.token_view, request.all_token_ids
    assert len(view) == len(full)
    assert view[start:stop:step] == full[start:stop:step]
    assert list(view) == full
    request.output_token_ids.append(7)  # a view, not a snapshot: it follows the request
    assert len(view) == len(full) + 1 and view[-1] == 7
