"""Oracle policies on a Mooncake trace, outside the bench (docs/eviction.md, "What knowing more
would reach"). A rougher model than `kvnode bench evict`: the cache is fed block by block (not
in the daemon's put ops), a victim is chosen before the new block enters, and in `reuse+lru` a
block stays after its last use. Its MIN matches the bench's within 0.001.

  lru        plain LRU
  reuse+lru  only blocks used again are admitted; LRU among them
  futcount   evict the fewest future uses left (ties: recency); blocks never used again dropped
  fc-tail    the same, ties: the oldest request, then a request's tail first (the bench's order)
  chainfut W evict the lowest  request index x 24 + W x capacity x uses left  (tail first)
  MIN        evict the farthest next use

Usage: python3 oracle-variants.py TRACE CAPACITIES
"""
import json, sys, heapq
from collections import OrderedDict
path=sys.argv[1]; caps=[int(x) for x in sys.argv[2].split(',')]
reqs=[json.loads(l)['hash_ids'] for l in open(path)]
last={}; nextuse=[None]*len(reqs); remaining=[None]*len(reqs); cnt={}
for ri in range(len(reqs)-1,-1,-1):
    nextuse[ri]=[last.get(b,1<<60) for b in reqs[ri]]
    remaining[ri]=[cnt.get(b,0) for b in reqs[ri]]
    for b in reqs[ri]: last[b]=ri; cnt[b]=cnt.get(b,0)+1
total=sum(len(r) for r in reqs)
def lru(cap, admit):
    c=OrderedDict(); hits=0
    for ri,r in enumerate(reqs):
        k=0
        while k<len(r) and r[k] in c: k+=1
        hits+=k
        for j,b in enumerate(r):
            if b in c: c.move_to_end(b); continue
            if not admit(ri,j): continue
            if len(c)>=cap: c.popitem(last=False)
            c[b]=1
    return hits/total
def keyed(cap, keyf):
    # evict lowest key; lazy heap; key recomputed at each reference
    c={}; h=[]; hits=0; t=0
    for ri,r in enumerate(reqs):
        k=0
        while k<len(r) and r[k] in c: k+=1
        hits+=k
        for j,b in enumerate(r):
            t+=1
            key=keyf(ri,j,t)
            if key is None:
                if b in c: del c[b]
                continue
            if b not in c and len(c)>=cap:
                while True:
                    kk,bb=heapq.heappop(h)
                    if c.get(bb)==kk: del c[bb]; break
            c[b]=key; heapq.heappush(h,(key,b))
    return hits/total
for cap in caps:
    out=[cap,'lru %.3f'%lru(cap,lambda ri,j:True),
     'reuse+lru %.3f'%lru(cap,lambda ri,j: nextuse[ri][j]<(1<<60)),
     'futcount %.3f'%keyed(cap,lambda ri,j,t: (remaining[ri][j],t) if remaining[ri][j]>0 else None),
     'MIN %.3f'%keyed(cap,lambda ri,j,t: (-(nextuse[ri][j]),-j) if nextuse[ri][j]<(1<<60) else None)]
    print(*out, flush=True)
print('--- variants')
for cap in caps:
    out=[cap]
    out.append('fc-tail %.3f'%keyed(cap,lambda ri,j,t: (remaining[ri][j],ri,-j) if remaining[ri][j]>0 else None))
    for W in (0.25,0.5,1,2,4,8):
        out.append('chainfut W%s %.3f'%(W,keyed(cap,lambda ri,j,t,W=W: (ri*24+W*cap*remaining[ri][j],-j) if remaining[ri][j]>0 else None)))
    print(*out, flush=True)
