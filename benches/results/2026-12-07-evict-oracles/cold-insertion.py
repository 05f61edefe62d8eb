# Usage: python3 cold-insertion.py TRACE CAPACITIES (fed block by block, outside the bench)
# LRU where new blocks of requests that continue a seen prefix (k > K) are inserted cold.
import json, sys
from collections import OrderedDict
reqs=[json.loads(l)['hash_ids'] for l in open(sys.argv[1])]
caps=[int(x) for x in sys.argv[2].split(',')]
total=sum(len(r) for r in reqs)
def run(cap, K, cold_frac):
    c=OrderedDict(); hits=0; seen=set()
    for r in reqs:
        h=0
        while h<len(r) and r[h] in c: h+=1
        hits+=h
        k=0
        while k<len(r) and r[k] in seen: k+=1
        cold = K is not None and k>K
        for j,b in enumerate(r):
            if b in c: c.move_to_end(b); continue
            if len(c)>=cap: c.popitem(last=False)
            c[b]=1
            if cold: c.move_to_end(b, last=False)
        # keep a request's new cold blocks head-before-tail: cold ones inserted at front in order j -> last inserted (deepest) is at the very front: evicted first. good.
        seen.update(r)
    return hits/total
for cap in caps:
    print(cap, 'lru %.3f'%run(cap,None,0), *['cold_k>%d %.3f'%(K,run(cap,K,0)) for K in (2,8,16)], flush=True)
