import heapq, random, sys
sys.path.insert(0, '/tmp/wt19')
from tokenflowd.federation.rejection import DecodeLoad, EarlyRejection
import os
P, NP, SLOTS, MEAN, SLO = float(os.environ.get("P",2)), int(os.environ.get("NP",4)), 32, 20.0, float(os.environ.get("SLO",12))
def run(predict, seed, dist, n=3000, window=5.0):
    rng = random.Random(seed)
    rate = 2 * SLOTS / MEAN
    load = DecodeLoad(SLOTS, MEAN); gate = EarlyRejection(load, predict=predict)
    free = [0.0]*NP; ev=[]; t=0.0; dec=[]; late=0; samples=[]
    for i in range(n):
        t += rng.expovariate(rate)
        while ev and ev[0][0] <= t:
            w,_,k,rid = heapq.heappop(ev)
            if k=="start":
                if load.current() >= SLOTS: load.finished(rid,w); late+=1; continue
                load.started(rid,w)
                d = rng.expovariate(1/MEAN) if dist=="exp" else MEAN if dist=="fixed" else rng.lognormvariate(0,1)*MEAN/1.6487
                heapq.heappush(ev,(w+d,rng.random(),"end",rid))
            else: load.finished(rid,w)
        node=min(range(NP),key=lambda k:free[k]); ttft=max(free[node],t)-t+P
        ok = ttft<=SLO and gate.admit(t,t+ttft); dec.append((t,ok))
        if ok:
            free[node]=t+ttft; load.accepted(f"r{i}",t+ttft); heapq.heappush(ev,(t+ttft,rng.random(),"start",f"r{i}"))
        samples.append(load.current())
    flips=sum(a[1]!=b[1] for a,b in zip(dec,dec[1:]))
    # windowed: fraction accepted per window, flips of (frac>0.5)
    wins={}
    for tt,ok in dec: wins.setdefault(int(tt//window),[]).append(ok)
    st=[sum(v)/len(v)>0.5 for k,v in sorted(wins.items())]
    wflips=sum(a!=b for a,b in zip(st,st[1:]))
    import statistics
    return dict(shed=dec.count(False) if False else sum(not o for _,o in dec)+late, late=late, flips=flips, wflips=wflips, load_sd=round(statistics.pstdev(samples),2))
for dist in ("fixed","exp","lognorm"):
    for s in (1,2):
        print(dist, s, "cur", run(False,s,dist), "pred", run(True,s,dist), "surv", run("survival",s,dist))
