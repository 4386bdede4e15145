import cProfile
import gc
import pstats

from bench.router import Codec, FleetConfig, Inbound, RouterIndex, _messages

messages = [
    Inbound("bench", 0, i, k, v)
    for i, (k, v) in enumerate(_messages(FleetConfig(instances=4, requests=500, seed=21)))
]
codec = Codec()
router = RouterIndex("localhost:1", "bench", "bench", codec=codec)
gc.collect()
pr = cProfile.Profile()
pr.enable()
router.apply(messages)
pr.disable()
st = pstats.Stats(pr)
st.sort_stats("tottime").print_stats(25)
