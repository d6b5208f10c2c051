"""``router.sim.service``: the engine profile (read, checked, interpolated). The step loop
that runs on it is in ``test_steps.py``."""
import json

import pytest

from router.sim.service import EngineProfile, ProfileService
from tests.support.engine_profiles import profile


def test_the_profile_interpolates_its_grids_and_adds_the_load_and_a_batch_step():
    service = ProfileService(profile())
    assert service.prefill_s(150, 0, 0, 150) == pytest.approx(1.5)
    # halfway in both directions, plus 500 / 16 blocks loaded at 1 ms each
    assert service.prefill_s(150, 500, 0, 650) == pytest.approx(1.75 + 0.03125)
    assert service.prefill_s(300, 0, 0, 300) == pytest.approx(3.0)  # the last segment extended
    assert service.prefill_s(100, 0, 2, 100) == pytest.approx(1.0 + 0.8)  # then one batch step
    assert service.step_s(1, 5000) == 0.5 and service.step_s(3, 100) == pytest.approx(1.1)


def test_a_profile_round_trips_and_refuses_another_model_or_block_size(tmp_path):
    path = tmp_path / "p.json"
    profile().write(path)
    read = EngineProfile.read(path)
    assert read == profile()
    read.check(16, "tiny")
    with pytest.raises(ValueError, match=r"measured with block size 16 \(the run uses 512\) and "
                                         r"model 'tiny' \(the run uses 'other'\)"):
        read.check(512, "other")
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "version": 9}))
    with pytest.raises(ValueError, match="expected version 1, got 9"):
        EngineProfile.read(path)
    path.write_text(json.dumps({k: v for k, v in data.items() if k != "step_s"}))
    with pytest.raises(ValueError, match="lacks or mistypes a field"):
        EngineProfile.read(path)
    with pytest.raises(ValueError, match="the decode grid is 2 x 2 but its values are not"):
        profile(step_s=((0.5,), (0.5,)))
