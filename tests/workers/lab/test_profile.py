"""``workers.lab.profile`` on a tiny forged model: the real engine measured on a small grid."""
import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
from router.sim.service import EngineProfile, ProfileService
from tests.support.forged_models import tiny_model
from workers.lab.profile import ProfileGrid, measure_profile

GRID = ProfileGrid(new_tokens=(4, 8), cached_tokens=(0, 8), batch_sizes=(1, 2), contexts=(8, 16),
                   draft_widths=(1, 4), decode_steps=2, repeats=1)


def test_the_engine_is_measured_on_the_grid_and_the_profile_round_trips(tmp_path):
    lines = []
    profile = measure_profile(tiny_model(), block_size=4, max_batch=2, grid=GRID,
                              progress=lines.append)
    assert (profile.model, profile.block_size, profile.max_batch) == ("llama", 4, 2)
    # 2 x 2 layers x 2 K/V heads x head dim 16 x 4 bytes (float32)
    assert profile.kv_bytes_per_token == 512
    assert (profile.new_tokens, profile.cached_tokens) == ((4, 8), (0, 8))
    assert (profile.batch_sizes, profile.contexts) == ((1, 2), (8, 16))
    assert all(v > 0 for row in profile.step_s for v in row)
    assert all(v >= 0 for row in profile.prefill_s for v in row) and profile.load_s() > 0
    assert len(lines) == 1 + 2 + 2 + 2 and lines[0].startswith("store load:")
    # verify passes: 2 widths x 2 batch sizes at the first context
    assert (profile.draft_widths, profile.verify_context) == ((1, 4), 8)
    assert len(profile.verify_s) == 2 and all(len(r) == 2 and min(r) > 0 for r in profile.verify_s)
    service = ProfileService(profile)
    over = profile.verify_s[1][1] / profile.step_s[0][1]  # width 4, batch 2, at context 8
    assert service.verify_step_s(2, 4, 16) == pytest.approx(over * profile.step_s[1][1])
    assert service.verify_step_s(2, 0, 16) == service.step_s(2, 16)
    path = tmp_path / "profile.json"
    profile.write(path)
    assert EngineProfile.read(path) == profile
    assert ProfileService(profile).prefill_s(4, 0, 0, 4) == pytest.approx(profile.prefill_s[0][0])


def test_a_grid_past_the_models_context_is_refused():
    with pytest.raises(ValueError, match="the profile grid reaches 4002 tokens but the model's "
                                         "context is 2048"):
        measure_profile(tiny_model(), grid=ProfileGrid(contexts=(4000,)))
